//! What kvpick reads from each engine's metrics, by engine type (DESIGN §4).

use std::str::FromStr;

use super::prom_text::Sample;

/// The serving engine of an endpoint (label `inference.networking.k8s.io/engine-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EngineKind {
    /// vLLM (the default).
    #[default]
    Vllm,
    /// SGLang.
    Sglang,
    /// TensorRT-LLM (`trtllm-serve`).
    TrtLlm,
}

/// An engine-type label value kvpick does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine type `{0}` (known: vllm, sglang, trtllm)")]
pub struct UnknownEngine(pub String);

impl FromStr for EngineKind {
    type Err = UnknownEngine;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            "trtllm" | "tensorrt-llm" | "trt-llm" => Ok(Self::TrtLlm),
            _ => Err(UnknownEngine(s.to_owned())),
        }
    }
}

/// The LoRA adapters an engine reports (`vllm:lora_requests_info`).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct LoraState {
    /// Adapters with running requests.
    pub running: Vec<String>,
    /// Adapters with waiting requests.
    pub waiting: Vec<String>,
    /// How many adapters fit at once.
    pub max_loras: u32,
}

/// One scrape's worth of what scheduling needs.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct PodMetrics {
    /// Requests waiting in the engine's queue.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV-cache usage, 0..=1 (blocks held by running requests, not the prefix cache).
    pub kv_usage: f64,
    /// Tokens per KV block, when the engine reports it.
    pub block_size: Option<u32>,
    /// KV blocks the engine has, when it reports it.
    pub num_blocks: Option<u64>,
    /// LoRA state (vLLM with LoRA enabled).
    pub lora: Option<LoraState>,
    /// kvpick's own requests to the pod that awaited their first byte when this scrape was
    /// taken (set by the scraper, not read from the engine): what of `waiting` was kvpick's
    /// at the same moment. Compared with the count at pick time instead, every request of
    /// kvpick's that got its first byte since the scrape would read as a foreign one waiting.
    pub own_awaiting: f64,
}

/// The engine's metrics lack a signal scheduling needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metric {0} is missing")]
pub struct MissingMetric(pub &'static str);

/// The engine process's start time (a changed one is a restarted engine).
pub const START_TIME: &str = "process_start_time_seconds";
/// vLLM's LoRA adapters metric.
const LORA_INFO: &str = "vllm:lora_requests_info";

struct Names {
    waiting: &'static str,
    running: &'static str,
    kv_usage: &'static [&'static str],
}

impl EngineKind {
    fn names(self) -> Names {
        match self {
            Self::Vllm => Names {
                waiting: "vllm:num_requests_waiting",
                running: "vllm:num_requests_running",
                kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            },
            Self::Sglang => Names {
                waiting: "sglang:num_queue_reqs",
                running: "sglang:num_running_reqs",
                kv_usage: &["sglang:token_usage"],
            },
            Self::TrtLlm => Names {
                waiting: "trtllm_num_requests_waiting",
                running: "trtllm_num_requests_running",
                kv_usage: &["trtllm_kv_cache_utilization"],
            },
        }
    }

    /// The metrics [`Self::extract`] (and the scraper's restart check) reads: the scraper
    /// parses only their lines.
    pub fn read_names(self) -> &'static [&'static str] {
        match self {
            Self::Vllm => &[
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
                START_TIME,
                "vllm:cache_config_info",
                LORA_INFO,
            ],
            Self::Sglang => &[
                "sglang:num_queue_reqs",
                "sglang:num_running_reqs",
                "sglang:token_usage",
                START_TIME,
                "sglang:cache_config_info",
            ],
            Self::TrtLlm => &[
                "trtllm_num_requests_waiting",
                "trtllm_num_requests_running",
                "trtllm_kv_cache_utilization",
                START_TIME,
                "trtllm_kv_cache_tokens_per_block",
                "trtllm_kv_cache_max_blocks",
            ],
        }
    }

    /// Reads the scheduling signals out of one exposition.
    ///
    /// Several series of one metric (data-parallel engines, one per `engine` label) are
    /// summed for queue lengths and averaged for KV usage. Non-finite values count as 0 for
    /// queues and 1 (full) for KV usage, so garbage never makes a pod look idle.
    pub fn extract(self, samples: &[Sample<'_>]) -> Result<PodMetrics, MissingMetric> {
        let names = self.names();
        let sum = |name: &'static str| -> Result<f64, MissingMetric> {
            let mut found = false;
            let mut total = 0.0;
            for s in samples.iter().filter(|s| s.name == name) {
                found = true;
                if s.value.is_finite() && s.value > 0.0 {
                    total += s.value;
                }
            }
            if found {
                Ok(total)
            } else {
                Err(MissingMetric(name))
            }
        };
        let waiting = sum(names.waiting)?;
        let running = sum(names.running)?;
        let kv_usage = names
            .kv_usage
            .iter()
            .find_map(|name| {
                let values: Vec<f64> = samples
                    .iter()
                    .filter(|s| s.name == *name)
                    .map(|s| {
                        if s.value.is_finite() {
                            s.value.clamp(0.0, 1.0)
                        } else {
                            1.0
                        }
                    })
                    .collect();
                (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
            })
            .ok_or(MissingMetric(names.kv_usage[0]))?;
        let (block_size, num_blocks) = self.cache_shape(samples);
        Ok(PodMetrics {
            waiting,
            running,
            kv_usage,
            block_size,
            num_blocks,
            lora: (self == Self::Vllm).then(|| lora_state(samples)).flatten(),
            own_awaiting: 0.0,
        })
    }

    fn cache_shape(self, samples: &[Sample<'_>]) -> (Option<u32>, Option<u64>) {
        let label_num = |name: &str, label: &str| {
            samples
                .iter()
                .find(|s| s.name == name)
                .and_then(|s| s.label(label))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let gauge = |name: &str| {
            samples
                .iter()
                .find(|s| s.name == name && s.value.is_finite() && s.value >= 0.0)
                .map(|s| s.value as u64)
        };
        let (block, blocks) = match self {
            Self::Vllm => (
                label_num("vllm:cache_config_info", "block_size"),
                label_num("vllm:cache_config_info", "num_gpu_blocks"),
            ),
            Self::Sglang => (
                label_num("sglang:cache_config_info", "page_size"),
                label_num("sglang:cache_config_info", "num_pages"),
            ),
            Self::TrtLlm => (
                gauge("trtllm_kv_cache_tokens_per_block"),
                gauge("trtllm_kv_cache_max_blocks"),
            ),
        };
        (
            block.and_then(|b| u32::try_from(b).ok()).filter(|b| *b > 0),
            blocks,
        )
    }
}

/// The newest `vllm:lora_requests_info` series (its value is a timestamp).
fn lora_state(samples: &[Sample<'_>]) -> Option<LoraState> {
    let newest = samples
        .iter()
        .filter(|s| s.name == LORA_INFO && s.value.is_finite())
        .max_by(|a, b| a.value.total_cmp(&b.value))?;
    let list = |label: &str| -> Vec<String> {
        newest
            .label(label)
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    Some(LoraState {
        running: list("running_lora_adapters"),
        waiting: list("waiting_lora_adapters"),
        max_loras: newest
            .label("max_lora")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scrape::prom_text::parse;

    #[test]
    fn reads_real_vllm_metrics() {
        let text = std::fs::read_to_string(
            crate::test_paths::fixtures().join("vllm-0.32-kv-events/metrics-load.txt"),
        )
        .expect("fixture");
        let metrics = EngineKind::Vllm
            .extract(&parse(&text).samples)
            .expect("vllm signals");
        assert_eq!(metrics.running, 4.0);
        assert_eq!(metrics.waiting, 0.0);
        assert!((metrics.kv_usage - 0.4444).abs() < 1e-3);
        assert_eq!(metrics.block_size, Some(32));
        assert_eq!(metrics.num_blocks, Some(64));
        assert_eq!(metrics.lora, None);
    }

    #[test]
    fn the_lines_the_scraper_reads_give_the_same_signals_as_all_of_them() {
        for file in ["metrics-idle.txt", "metrics-load.txt", "metrics-final.txt"] {
            let text = std::fs::read_to_string(
                crate::test_paths::fixtures()
                    .join("vllm-0.32-kv-events")
                    .join(file),
            )
            .expect("fixture");
            let all = parse(&text);
            let read = crate::scrape::prom_text::parse_wanted(&text, EngineKind::Vllm.read_names());
            assert_eq!(
                EngineKind::Vllm.extract(&read.samples),
                EngineKind::Vllm.extract(&all.samples),
                "{file}"
            );
            let start = |samples: &[Sample<'_>]| {
                samples
                    .iter()
                    .find(|s| s.name == START_TIME)
                    .map(|s| s.value)
            };
            assert!(start(&all.samples).is_some(), "{file} has a start time");
            assert_eq!(start(&read.samples), start(&all.samples), "{file}");
            assert!(
                read.samples.len() * 10 < all.samples.len(),
                "{file}: {} of {} samples read",
                read.samples.len(),
                all.samples.len()
            );
        }
        let sglang = "sglang:num_queue_reqs 3\nsglang:num_running_reqs 7\nsglang:token_usage 0.5\nsglang:cache_config_info{page_size=\"64\",num_pages=\"1000\"} 1\nother 1\n";
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 0.25\ntrtllm_kv_cache_tokens_per_block 32\ntrtllm_kv_cache_max_blocks 512\nother 1\n";
        for (engine, text) in [(EngineKind::Sglang, sglang), (EngineKind::TrtLlm, trt)] {
            let read = crate::scrape::prom_text::parse_wanted(text, engine.read_names());
            let lines = text.lines().count();
            assert_eq!(
                read.samples.len(),
                lines - 1,
                "{engine:?} reads all but `other`"
            );
            assert_eq!(
                engine.extract(&read.samples),
                engine.extract(&parse(text).samples)
            );
        }
    }

    #[test]
    fn every_signal_extract_reads_is_among_the_lines_the_scraper_parses() {
        for engine in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::TrtLlm] {
            let names = engine.names();
            let read = engine.read_names();
            for name in [names.waiting, names.running]
                .into_iter()
                .chain(names.kv_usage.iter().copied())
                .chain([START_TIME])
            {
                assert!(read.contains(&name), "{engine:?}: {name}");
            }
        }
    }

    #[test]
    fn reads_sglang_and_trtllm_names() {
        let sglang = parse(
            "sglang:num_queue_reqs{dp=\"0\"} 3\nsglang:num_queue_reqs{dp=\"1\"} 2\nsglang:num_running_reqs 7\nsglang:token_usage 0.5\nsglang:cache_config_info{page_size=\"64\",num_pages=\"1000\"} 1\n",
        );
        let m = EngineKind::Sglang.extract(&sglang.samples).expect("sglang");
        assert_eq!((m.waiting, m.running, m.kv_usage), (5.0, 7.0, 0.5));
        assert_eq!((m.block_size, m.num_blocks), (Some(64), Some(1000)));
        let trt = parse(
            "trtllm_num_requests_waiting 1\ntrtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 0.25\ntrtllm_kv_cache_tokens_per_block 32\ntrtllm_kv_cache_max_blocks 512\n",
        );
        let m = EngineKind::TrtLlm.extract(&trt.samples).expect("trtllm");
        assert_eq!((m.waiting, m.running, m.kv_usage), (1.0, 2.0, 0.25));
        assert_eq!((m.block_size, m.num_blocks), (Some(32), Some(512)));
    }

    #[test]
    fn missing_and_garbage_values_are_safe() {
        let none = parse("vllm:num_requests_running 1\n");
        assert_eq!(
            EngineKind::Vllm.extract(&none.samples),
            Err(MissingMetric("vllm:num_requests_waiting"))
        );
        let garbage = parse(
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running -3\nvllm:gpu_cache_usage_perc +Inf\n",
        );
        let m = EngineKind::Vllm
            .extract(&garbage.samples)
            .expect("older name accepted");
        assert_eq!((m.waiting, m.running, m.kv_usage), (0.0, 0.0, 1.0));
    }

    #[test]
    fn newest_lora_series_wins() {
        let text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 100\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a, b\",waiting_lora_adapters=\"c\"} 200\n";
        let m = EngineKind::Vllm
            .extract(&parse(text).samples)
            .expect("vllm");
        assert_eq!(
            m.lora,
            Some(LoraState {
                running: vec!["a".into(), "b".into()],
                waiting: vec!["c".into()],
                max_loras: 4
            })
        );
    }

    #[test]
    fn engine_labels() {
        assert_eq!("vLLM".parse(), Ok(EngineKind::Vllm));
        assert_eq!("sglang".parse(), Ok(EngineKind::Sglang));
        assert_eq!("trtllm".parse(), Ok(EngineKind::TrtLlm));
        assert!("tgi".parse::<EngineKind>().is_err());
    }
}
