{{/* The picker's name (llm-d's: <release>-epp): Deployment, Services, ServiceAccount. */}}
{{- define "kvpick.name" -}}
{{- $base := .Release.Name | default "default-pool" | lower | trim | trunc 40 -}}
{{ $base }}-epp
{{- end -}}

{{/* The InferencePool's name (llm-d's: the release name). */}}
{{- define "kvpick.poolName" -}}
{{ .Release.Name }}
{{- end -}}

{{- define "kvpick.labels" -}}
app.kubernetes.io/name: {{ include "kvpick.name" . }}
app.kubernetes.io/part-of: kvpick
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* llm-d's selector and mode labels. */}}
{{- define "kvpick.selectorLabels" -}}
{{- if .Values.router.inferencePool.create -}}
llm-d-router-gateway: {{ include "kvpick.name" . }}
{{- else -}}
llm-d-router-standalone: {{ include "kvpick.name" . }}
{{- end -}}
{{- end -}}

{{- define "kvpick.modeLabels" -}}
{{- if .Values.router.inferencePool.create -}}
llm-d.ai/igw-mode: llm-d-router-gateway
{{- else -}}
llm-d.ai/igw-mode: llm-d-router-standalone
{{- end -}}
{{- end -}}

{{/* "true" when replicas wait on a Lease (llm-d: replicas > 1), else "". */}}
{{/* The replica exchange: active-active with more than one replica. */}}
{{- define "kvpick.replicaExchange" -}}
{{- if and (gt (int .Values.router.epp.replicas) 1) .Values.router.epp.activeActive -}}
true
{{- end -}}
{{- end -}}

{{/* The Deployment's own pods as a --peer-selector (selectorLabels as k=v). */}}
{{- define "kvpick.peerSelector" -}}
{{- if .Values.router.inferencePool.create -}}
llm-d-router-gateway={{ include "kvpick.name" . }}
{{- else -}}
llm-d-router-standalone={{ include "kvpick.name" . }}
{{- end -}}
{{- end -}}

{{- define "kvpick.leaderElection" -}}
{{- if and (gt (int .Values.router.epp.replicas) 1) (not .Values.router.epp.activeActive) -}}
true
{{- end -}}
{{- end -}}

{{/* modelServers.matchLabels as k=v,k2=v2 (sorted: Go templates range maps by key). */}}
{{- define "kvpick.selector" -}}
{{- $labels := list -}}
{{- range $k, $v := .Values.router.modelServers.matchLabels -}}
{{- $labels = append $labels (printf "%s=%s" $k $v) -}}
{{- end -}}
{{ join "," $labels }}
{{- end -}}

{{- define "kvpick.targetPorts" -}}
{{- $ports := list -}}
{{- range .Values.router.modelServers.targetPorts -}}
{{- $ports = append $ports (toString .number) -}}
{{- end -}}
{{ join "," $ports }}
{{- end -}}

{{/* Fails the render on values that make no working deployment. */}}
{{- define "kvpick.validate" -}}
{{- if empty .Values.router.modelServers.matchLabels -}}
{{- fail "router.modelServers.matchLabels is required: the model servers' pod labels" -}}
{{- end -}}
{{- if and .Values.router.epp.tls.secretName (not .Values.router.epp.secureServing) -}}
{{- fail "router.epp.tls.secretName needs router.epp.secureServing: true" -}}
{{- end -}}
{{- if and .Values.httpRoute.create (not .Values.router.inferencePool.create) -}}
{{- fail "httpRoute.create names the InferencePool: it needs router.inferencePool.create" -}}
{{- end -}}
{{- if and .Values.provider.envoyGateway.extProcPolicy (not .Values.httpRoute.create) -}}
{{- fail "provider.envoyGateway.extProcPolicy attaches to the chart's HTTPRoute: set httpRoute.create" -}}
{{- end -}}
{{- end -}}
