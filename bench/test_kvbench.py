"""Unit tests of the benchmark's workload settings and statistics on known inputs.

Run by crates/kvpick-bench/tests/compare_smoke.rs (so `cargo nextest run` covers them) and
directly with `python -m unittest bench/test_kvbench.py`. Standard library only, except the
seeded-arrivals test, which needs the benchmark venv's inference-perf (skipped without it
here; the Rust test always runs them with the venv)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvbench import stats  # noqa: E402
from kvbench.workload import Workload, blocks_per_pod, inference_perf_config, max_concurrency  # noqa: E402


class WorkloadTest(unittest.TestCase):
    def test_gie_shaped_workload_sizes_a_pod_to_a_third_of_the_prefixes(self):
        w = Workload(groups=45, prompts_per_group=5, system_len=2000, question_len=200, output_len=64)
        # 45 × 2000 tokens = 5625 blocks of 16; a third is 1875; one request of
        # ceil(2264 / 16) = 142 blocks of headroom; +1 null block.
        self.assertEqual(blocks_per_pod(w, 16), 1875 + 142 + 1)
        self.assertEqual(blocks_per_pod(w, 16, headroom_requests=8), 1875 + 8 * 142 + 1)
        self.assertEqual(blocks_per_pod(w, 16, headroom_requests=0), 1876)

    def test_inference_perf_config_carries_every_setting(self):
        w = Workload(groups=7, prompts_per_group=3, system_len=100, question_len=10, output_len=5,
                     rates=[2.0, 5.0], stage_seconds=10, seed=9)
        cfg = inference_perf_config(w, "http://127.0.0.1:1", "m", "/tok", "/out")
        sp = cfg["data"]["shared_prefix"]
        self.assertEqual(
            (sp["num_groups"], sp["num_prompts_per_group"], sp["system_prompt_len"], sp["question_len"], sp["output_len"], sp["seed"]),
            (7, 3, 100, 10, 5, 9),
        )
        self.assertEqual(cfg["load"]["type"], "poisson")
        self.assertEqual(cfg["load"]["stages"], [{"rate": 2.0, "duration": 10}, {"rate": 5.0, "duration": 10}])
        # Slots above the run's request count (2×10 + 5×10 = 70), so overload is not hidden.
        self.assertEqual(cfg["load"]["worker_max_concurrency"], 170)
        self.assertEqual(max_concurrency(w), 170)
        self.assertTrue(cfg["api"]["streaming"])
        self.assertEqual(cfg["server"], {"type": "vllm", "model_name": "m", "base_url": "http://127.0.0.1:1", "ignore_eos": True})
        self.assertEqual(cfg["tokenizer"]["pretrained_model_name_or_path"], "/tok")

    def test_bad_settings_are_rejected(self):
        for bad in [dict(groups=0), dict(rates=[]), dict(rates=[1.0, -2.0]), dict(output_len=0), dict(api="grpc")]:
            with self.assertRaises(ValueError, msg=str(bad)):
                Workload(**bad).validate()
        with self.assertRaises(ValueError):
            blocks_per_pod(Workload(), 0)


class StatsTest(unittest.TestCase):
    def test_percentiles_interpolate_like_numpy(self):
        xs = [10, 1, 4, 7, 2]
        self.assertEqual(stats.percentile(xs, 50), 4)
        self.assertEqual(stats.percentile(xs, 0), 1)
        self.assertEqual(stats.percentile(xs, 100), 10)
        self.assertAlmostEqual(stats.percentile(xs, 90), 8.8)  # numpy.percentile([..], 90)
        self.assertAlmostEqual(stats.percentile([1, 2, 3, 4], 25), 1.75)
        self.assertIsNone(stats.percentile([], 50))
        with self.assertRaises(ValueError):
            stats.percentile([1], 101)

    def test_cdf_steps_to_one(self):
        xs, ys = stats.cdf([3, 1, 2, 2])
        self.assertEqual(xs, [1, 2, 2, 3])
        self.assertEqual(ys, [0.25, 0.5, 0.75, 1.0])

    def test_pod_counters_and_fleet_hit_rate_from_metrics_text(self):
        pod_a = (
            "# HELP vllm:prefix_cache_hits_total x\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400\n'
            'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 6\n'
            'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0"} 5\n'
            "garbage line without value\n"
        )
        pod_b = (
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600\n'
            'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2\n'
        )
        a, b = stats.pod_counters(pod_a), stats.pod_counters(pod_b)
        self.assertEqual((a["prefix_hits"], a["prefix_queries"], a["finished"]), (300, 400, 6))
        s = stats.fleet_summary([a, b])
        self.assertEqual(s["engine_hit_rate"], 400 / 1000)  # Σ hits / Σ queries, not a mean of rates
        self.assertEqual(s["requests_per_pod"], [6, 2])
        self.assertEqual(s["load_imbalance"], 6 / 4)
        d = stats.counters_delta([a], [{"prefix_hits": 100, "prefix_queries": 100, "finished": 1, "preemptions": 0}])
        self.assertEqual((d[0]["prefix_hits"], d[0]["prefix_queries"], d[0]["finished"]), (200, 300, 5))
        self.assertIsNone(stats.fleet_summary([stats.pod_counters("")])["engine_hit_rate"])

    def _entry(self, start, first, prompt, cached):
        return {
            "start_time": start,
            "info": {"response_metrics": {
                "output_token_times": [first, first + 0.01],
                "server_usage": {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}},
            }},
        }

    def test_per_request_ttft_cached_tokens_and_stage_split(self):
        entries = [self._entry(5.0, 5.5, 100, 0), self._entry(1.0, 1.25, 100, 50), self._entry(2.0, 2.1, 200, 200)]
        self.assertAlmostEqual(stats.request_ttft(entries[1]), 0.25)
        self.assertIsNone(stats.request_ttft({"start_time": 1.0, "info": {}}))
        self.assertEqual(stats.request_cached_tokens(entries[2]), (200, 200))
        first, second = stats.split_by_stage(entries, [2, 1])
        self.assertEqual([e["start_time"] for e in first], [1.0, 2.0])
        self.assertEqual([e["start_time"] for e in second], [5.0])

    def test_stage_row_reads_the_stage_report(self):
        lat = lambda m, p90: {"mean": m, "median": m, "p90": p90, "p99": p90}  # noqa: E731
        stage = {
            "load_summary": {"achieved_rate": 3.9},
            "successes": {
                "count": 3,
                "latency": {"time_to_first_token": lat(0.2, 0.4), "inter_token_latency": lat(0.01, 0.02),
                            "request_latency": lat(1.0, 2.0)},
                "throughput": {"output_tokens_per_sec": 120.0, "requests_per_sec": 3.0},
            },
            "failures": {"count": 1},
        }
        entries = [self._entry(1.0, 1.25, 100, 50), self._entry(2.0, 2.1, 300, 150)]
        row = stats.stage_row("rr", 4.0, stage, entries)
        self.assertEqual((row["requests"], row["failures"]), (4, 1))
        self.assertEqual((row["ttft_mean"], row["ttft_p90"], row["e2e_p90"], row["output_tok_s"]), (0.2, 0.4, 2.0, 120.0))
        self.assertEqual(row["response_hit_rate"], 200 / 400)
        self.assertEqual(len(row["ttft_per_request"]), 2)


class SeededArrivalsTest(unittest.TestCase):
    def test_the_poisson_timer_sends_at_the_same_offsets_every_run(self):
        try:
            import numpy  # noqa: F401
            from inference_perf.loadgen import load_timer
        except ImportError:
            self.skipTest("inference-perf is not installed in this interpreter")
        import ipf_seeded

        def offsets():
            ipf_seeded.install()
            gen = load_timer.PoissonLoadTimer(rate=20.0, duration=5.0).start_timer(initial=0.0)
            return [next(gen) for _ in range(60)]

        a, b = offsets(), offsets()
        self.assertEqual(a, b)
        self.assertTrue(all(x < y for x, y in zip(a, a[1:])))
        # About 20 per second: 60 sends within 2..4.5 s for any reasonable draw.
        self.assertTrue(2.0 < a[-1] < 4.5, a[-1])
        os.environ["KVPICK_BENCH_SEED"] = "2"
        try:
            self.assertNotEqual(offsets(), a)
        finally:
            del os.environ["KVPICK_BENCH_SEED"]


if __name__ == "__main__":
    unittest.main()
