//! The replies that carry a pick to the gateway, in the way its request-body mode
//! ([`RequestBodyMode`]) needs.

use bytes::Bytes;

use super::{Phase, RequestEnd, RequestStream};
use crate::extproc::handoff::{PICK_NAMESPACE, PickHandoff};
use crate::extproc::mutations;
use crate::extproc::prepare::Prepared;
use crate::extproc::request_body::RequestBodyMode;
use crate::extproc::response::ResponseBody;
use crate::extproc::scores;
use crate::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use crate::scheduling::Pick;

impl RequestStream {
    /// The replies that send the request on to `pick`: the destination header (and score
    /// headers), the body (rewritten or as received) and trailers — or, when Envoy holds the
    /// body (`BUFFERED`), one answer to it with the same headers and no body unless
    /// rewritten; the response phase is armed to restore a rewritten model name.
    pub(super) fn reply(
        &mut self,
        pick: &Pick,
        prepared: Option<&Prepared>,
    ) -> Vec<ProcessingResponse> {
        let destination = pick.header_value();
        tracing::debug!(%destination, bytes = self.body.len(), "picked");
        let has_body = self.end != RequestEnd::Bodyless;
        let rewritten = prepared.and_then(|p| p.rewritten_body.clone());
        let control_headers = std::mem::take(&mut self.meta.control_headers);
        let extra = scores::pick_headers(pick);
        let mut out = match self.request_mode {
            // NOTE: Envoy forwards the body it holds: no bytes go back, which is the point of
            // the mode (kvpick encodes, and Envoy decodes, no copy of a long prompt).
            RequestBodyMode::Buffered if has_body => vec![mutations::request_body_decision(
                &destination,
                rewritten,
                control_headers,
                &extra,
            )],
            _ => {
                // NOTE: the body goes back as slices of what was buffered (or of the
                // rewrite), not copies: it lives until the last chunk is encoded onto the
                // connection, as the copies did, and the budget is returned below as it was
                // for them. The buffer's growth slack is given back first (shrinking in
                // place: no copy), so what stays pinned past the budget is the body's own
                // bytes, not up to twice them.
                let forwarded = rewritten.unwrap_or_else(|| {
                    let mut body = std::mem::take(&mut self.body);
                    body.shrink_to_fit();
                    Bytes::from(body)
                });
                let mut out = vec![mutations::request_headers_response(
                    &destination,
                    has_body.then_some(forwarded.len()),
                    control_headers,
                    &extra,
                )];
                if has_body {
                    out.extend(mutations::request_body_chunks(
                        forwarded,
                        self.end == RequestEnd::Body,
                    ));
                }
                if self.end == RequestEnd::Trailers {
                    out.push(mutations::request_trailers_continue());
                }
                out
            }
        };
        if let (true, Some(routed), Some(metadata)) = (
            self.split,
            self.routed.as_ref(),
            out.first_mut().and_then(|r| r.dynamic_metadata.as_mut()),
        ) {
            let handoff = PickHandoff {
                endpoint: pick.primary.addr(),
                uncached_tokens: pick.expected.uncached_tokens.unwrap_or(0.0),
                cached_tokens: pick.expected.cached_tokens,
                predicted_ms: pick.expected.ttft_ms,
                streamed: self.streamed,
                labels: routed.labels.clone(),
                reservation: self.reservation,
            };
            metadata
                .fields
                .insert(PICK_NAMESPACE.to_owned(), handoff.to_value());
        }
        if let Some(p) = prepared.filter(|p| p.rewritten_body.is_some()) {
            self.response =
                ResponseBody::restoring(&p.client_model, p.stream, self.ctx.max_body_bytes);
        }
        // NOTE: the budget is returned once the chunks are built; they wait only in the
        // gateway-facing send path of this stream.
        self.release_body();
        // Split: the gateway closes this stream once the request is through, and the
        // response half is the observing stream's.
        self.phase = if self.split {
            Phase::Done
        } else {
            Phase::AwaitResponse
        };
        out
    }
}
