"""Unit tests of the benchmark's workload settings and statistics on known inputs.

Run by crates/kvpick-bench/tests/compare_smoke.rs (so `cargo nextest run` covers them) and
directly with `python -m unittest bench/test_kvbench.py`. Standard library only, except the
seeded-arrivals test, which needs the benchmark venv's inference-perf (skipped without it
here; the Rust test always runs them with the venv)."""

import asyncio
import datetime
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import copies  # noqa: E402
from kvbench import conversations, report, shifting, stats  # noqa: E402
from kvbench.workload import Workload, blocks_per_pod, inference_perf_config, max_concurrency, shifting_spec  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class WorkloadKindsTest(unittest.TestCase):
    def test_multi_turn_is_conversation_replay_with_fixed_turn_shapes(self):
        w = Workload(kind="multi-turn", conversations=10, turns=4, shared_len=50, system_len=300,
                     question_len=20, output_len=8, rates=[2.0], stage_seconds=10, seed=5)
        cfg = inference_perf_config(w, "http://h:1", "m", "/tok", "/out")
        self.assertEqual(cfg["data"]["type"], "conversation_replay")
        cr = cfg["data"]["conversation_replay"]
        self.assertEqual((cr["seed"], cr["num_conversations"], cr["shared_system_prompt_len"]), (5, 10, 50))
        for key, want in [("dynamic_system_prompt_len", 300), ("turns_per_conversation", 4),
                          ("input_tokens_per_turn", 20), ("output_tokens_per_turn", 8)]:
            d = cr[key]
            self.assertEqual((d["type"], d["min"], d["max"], d["mean"], d["std_dev"]), ("fixed", want, want, want, 0.0), key)
        # The longest conversation is 50 + 300 + 4 × (20 + 8) = 462 tokens; history is never cut.
        self.assertEqual(cr["max_model_len"], 2 * 462 + 512)
        # Working set: the shared prompt once, every conversation at its longest.
        self.assertEqual(w.working_set_tokens(), 50 + 10 * (300 + 4 * 28))
        # ceil(4170 / 16) = 261 blocks; a third is 87; one longest conversation
        # ceil(462 / 16) = 29 of headroom; +1 null block.
        self.assertEqual(blocks_per_pod(w, 16), 87 + 29 + 1)
        with self.assertRaises(ValueError):
            Workload(kind="multi-turn", api="chat").validate()

    def test_no_sharing_is_random_prompts_of_the_full_length(self):
        w = Workload(kind="no-sharing", system_len=100, question_len=20, output_len=7, rates=[2.0, 3.5], stage_seconds=10)
        self.assertEqual(w.stage_requests(), [20, 35])
        data = inference_perf_config(w, "http://h:1", "m", "/tok", "/out")["data"]
        self.assertEqual(data["type"], "random")
        self.assertEqual(data["input_distribution"]["min"], 120)
        self.assertEqual(data["input_distribution"]["max"], 120)
        self.assertEqual(data["output_distribution"]["mean"], 7.0)
        # Each stage restarts inference-perf's index: the largest stage bounds the draws.
        self.assertEqual(data["input_distribution"]["total_count"], 36)
        self.assertIsNone(shifting_spec(w))

    def test_shifting_moves_most_requests_to_a_new_disjoint_hot_set_halfway(self):
        w = Workload(kind="shifting", groups=20, prompts_per_group=3, hot_fraction=0.25, hot_share=0.9,
                     rates=[10.0, 20.0], stage_seconds=20, seed=3)
        spec = shifting_spec(w)
        self.assertEqual(spec["stage_requests"], [200, 400])
        self.assertEqual(inference_perf_config(w, "u", "m", "/t", "/o")["data"]["type"], "shared_prefix")
        sets = [set(shifting.hot_set(p, 20, 0.25)) for p in range(4)]
        self.assertEqual(sets[0], {0, 1, 2, 3, 4})
        self.assertEqual(sets[1], {5, 6, 7, 8, 9})
        self.assertEqual(shifting.hot_set(4, 20, 0.25), shifting.hot_set(0, 20, 0.25))  # wraps
        for stage, n in enumerate(spec["stage_requests"]):
            first = [shifting.group_for(stage, i, spec) for i in range(n // 2)]
            second = [shifting.group_for(stage, i, spec) for i in range(n // 2, n)]
            hot_a, hot_b = sets[2 * stage], sets[2 * stage + 1]
            share_a = sum(g in hot_a for g in first) / len(first)
            share_b = sum(g in hot_b for g in second) / len(second)
            # 90% expected; a binomial draw of 100..200 stays within ±8 points.
            self.assertTrue(0.82 <= share_a <= 0.98, share_a)
            self.assertTrue(0.82 <= share_b <= 0.98, share_b)
            self.assertLess(sum(g in hot_a for g in second) / len(second), 0.1)
        # Deterministic: the same request gets the same group in every system's run.
        self.assertEqual([shifting.group_for(1, i, spec) for i in range(50)],
                         [shifting.group_for(1, i, spec) for i in range(50)])
        groups_of_prompts = [g for g in range(20) for _ in range(3)][::-1]
        for i in range(30):
            idx = shifting.prompt_index(0, i, spec, groups_of_prompts)
            self.assertEqual(groups_of_prompts[idx], shifting.group_for(0, i, spec))
        for bad in [dict(hot_fraction=0.6), dict(hot_share=1.5), dict(groups=1)]:
            with self.assertRaises(ValueError, msg=str(bad)):
                Workload(kind="shifting", **bad).validate()


class ConversationOrderTest(unittest.TestCase):
    def test_every_round_visits_each_conversation_once_in_a_seeded_order(self):
        c = 8
        sends = [conversations.shuffled_index(i, c, seed=42) for i in range(3 * c)]
        for rnd in range(3):
            chunk = sends[rnd * c:(rnd + 1) * c]
            # Same round, every conversation once.
            self.assertEqual(sorted(chunk), list(range(rnd * c, (rnd + 1) * c)))
        # Not the fixed cycle (which is what makes round robin accidentally sticky).
        self.assertNotEqual([x % c for x in sends[:c]], list(range(c)))
        self.assertNotEqual([x % c for x in sends[:c]], [x % c for x in sends[c:2 * c]])
        self.assertEqual(sends, [conversations.shuffled_index(i, c, seed=42) for i in range(3 * c)])
        self.assertNotEqual(sends, [conversations.shuffled_index(i, c, seed=43) for i in range(3 * c)])
        with self.assertRaises(ValueError):
            conversations.shuffled_index(0, 0, seed=1)

    def test_behind_round_robin_a_conversation_changes_pod_about_as_often_as_chance(self):
        # With the fixed cycle and 96 conversations on 8 pods, round robin puts every turn of
        # a conversation on the same pod; shuffled, it stays with probability about 1/8.
        c, pods = 96, 8
        pod_of = {}
        same = total = 0
        for i in range(6 * c):
            conv = conversations.shuffled_index(i, c, seed=42) % c
            pod = i % pods
            if conv in pod_of:
                total += 1
                same += pod == pod_of[conv]
            pod_of[conv] = pod
        self.assertLess(same / total, 0.25)
        fixed_same = sum(1 for i in range(c, 6 * c) if i % pods == (i - c) % pods)
        self.assertEqual(fixed_same, 5 * c)


class ProgressTest(unittest.TestCase):
    def test_a_log_left_by_an_earlier_run_marks_no_stage(self):
        import tempfile

        import compare

        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "inference-perf.log")
            with open(log, "w") as f:
                f.write("Stage 0 - run started\nStage 0 - run completed\n")
            progress = compare.Progress("t", fleet=[], log_path=log, expected=1)
            counters = [{"waiting": 0.0, "running": 0.0, "finished": 0.0}]

            def scrape_once(_fleet):
                progress.stop.set()  # one pass of the loop
                return counters

            real_scrape, compare.scrape = compare.scrape, scrape_once
            try:
                progress.run()
                self.assertEqual(progress.marks, {})
                # This run's own lines are marked.
                with open(log, "w") as f:
                    f.write("Stage 0 - run started\n")
                progress.stop.clear()
                progress.run()
                self.assertEqual(list(progress.marks), [(0, "started")])
            finally:
                compare.scrape = real_scrape


class ScenarioTest(unittest.TestCase):
    def test_build_workload_applies_the_kind_and_the_command_line(self):
        import compare

        w = compare.build_workload("default", "multi-turn", rates="3,6", stage_seconds=12)
        self.assertEqual((w.kind, w.conversations, w.turns, w.shared_len, w.system_len), ("multi-turn", 90, 8, 200, 1000))
        self.assertEqual((w.rates, w.stage_seconds), ([3.0, 6.0], 12))
        # At the default top rate (24 req/s × 30 s) no conversation runs past its 8 turns,
        # so none starts over and repeats its first question.
        self.assertLessEqual(24 * 30 / w.conversations, w.turns)
        self.assertEqual(compare.build_workload("quick", "shared-prefix").kind, "shared-prefix")
        env = compare.ipf_env(compare.build_workload("default", "shifting"))
        self.assertEqual(json.loads(env["KVPICK_BENCH_SHIFTING"])["groups"], 45)
        self.assertEqual(compare.ipf_env(compare.build_workload("default", "no-sharing"))["KVPICK_BENCH_SHIFTING"], "")

    def test_the_api_option_reaches_inference_perf_and_is_checked(self):
        import compare
        from kvbench.workload import inference_perf_config

        self.assertEqual(compare.build_workload("default", "shared-prefix").api, "completion")
        chat = compare.build_workload("smoke", "shared-prefix", api="chat")
        cfg = inference_perf_config(chat, "http://127.0.0.1:1", "m", "tok", "/tmp/out")
        self.assertEqual(cfg["api"], {"type": "chat", "streaming": True})
        # inference-perf 0.7.0's multi-turn and random data speak completions only.
        for kind in ("multi-turn", "no-sharing"):
            with self.assertRaises(ValueError):
                compare.build_workload("default", kind, api="chat")

    def test_a_kvpick_config_becomes_a_system_and_a_missing_file_is_refused(self):
        import tempfile

        from kvbench import systems

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("kind: EndpointPickerConfig\n")
        try:
            name = systems.add_kvpick_config("variant", f.name)
            self.assertEqual(name, "kvpick-variant")
            self.assertIn(os.path.basename(f.name), systems.SYSTEMS[name]["flags"])
        finally:
            systems.SYSTEMS.pop("kvpick-variant", None)
            os.unlink(f.name)
        with self.assertRaises(ValueError):
            systems.add_kvpick_config("gone", f.name)
        self.assertNotIn("kvpick-gone", systems.SYSTEMS)

    def test_kvpick_flags_become_a_system_and_harness_flags_are_refused(self):
        from kvbench import systems

        try:
            name = systems.add_kvpick_flags("slow", "--recommended-profile --scrape-interval 200ms")
            self.assertEqual(name, "kvpick-slow")
            self.assertIn("--scrape-interval 200ms", systems.SYSTEMS[name]["flags"])
        finally:
            systems.SYSTEMS.pop("kvpick-slow", None)
        for bad in ("", "--grpc-port 1", "--metrics-port=9"):
            with self.assertRaises(ValueError):
                systems.add_kvpick_flags("bad", bad)
        self.assertNotIn("kvpick-bad", systems.SYSTEMS)

    def test_system_headers_go_to_their_system_only(self):
        import compare

        self.assertEqual(
            compare.system_headers(["kvpick-slo:x-llm-d-slo-ttft-ms=300", "kvpick-slo:x-b = 2", "smg-cache-aware:x-c=3"]),
            {"kvpick-slo": {"x-llm-d-slo-ttft-ms": "300", "x-b": "2"}, "smg-cache-aware": {"x-c": "3"}},
        )
        self.assertEqual(compare.system_headers([]), {})
        for bad in ["no-colon=1", "sys:no-equals", ":x=1", "sys:=1"]:
            with self.assertRaises(ValueError, msg=bad):
                compare.system_headers([bad])

    def test_cpu_is_summed_over_a_session_from_proc_stat(self):
        import tempfile

        from kvbench import procs, report

        tick = os.sysconf("SC_CLK_TCK")

        def stat(pid, comm, session, utime, stime, cutime=0, cstime=0):
            # Fields 3.. of /proc/<pid>/stat: state ppid pgrp session tty tpgid flags minflt
            # cminflt majflt cmajflt utime stime cutime cstime ...
            rest = ["S", "1", str(session), str(session), "0", "-1", "0", "0", "0", "0", "0",
                    str(utime), str(stime), str(cutime), str(cstime), "20", "0"]
            return f"{pid} ({comm}) " + " ".join(rest) + "\n"

        with tempfile.TemporaryDirectory() as d:
            for pid, text in [(100, stat(100, "smg", 100, 3 * tick, tick)),
                              (101, stat(101, "smg worker) x", 100, tick, 0, tick, 0)),
                              (200, stat(200, "other", 200, 50 * tick, 0))]:
                os.makedirs(os.path.join(d, str(pid)))
                with open(os.path.join(d, str(pid), "stat"), "w") as f:
                    f.write(text)
            os.makedirs(os.path.join(d, "self"))
            self.assertEqual(procs.session_cpu_seconds(100, proc=d), 6.0)
            self.assertEqual(procs.session_cpu_seconds(300, proc=d), 0.0)
        table = report.cpu_table([{"system": "kvpick-recommended", "requests_per_pod": [60, 40],
                                   "cpu_seconds_under_load": {"kvpick": 0.5, "envoy": 1.0}}])
        self.assertIn("- kvpick-recommended: envoy 1.0 s (10.00 ms/request), kvpick 0.5 s (5.00 ms/request)", table)
        self.assertEqual(report.cpu_table([{"system": "x"}]), "")

    def test_the_pods_time_series_is_one_row_per_sample(self):
        import tempfile

        import compare

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "series.csv")
            compare.write_pod_series(path, [(0.0, [1, 0], [2, 3], [0, 0]), (1.1, [0, 4], [5, 6], [1, 2])])
            with open(path) as f:
                lines = f.read().splitlines()
            self.assertEqual(lines, ["t,waiting_0,waiting_1,running_0,running_1,finished_0,finished_1",
                                     "0.0,1,0,2,3,0,0", "1.1,0,4,5,6,1,2"])
            compare.write_pod_series(os.path.join(d, "none.csv"), [])
            self.assertFalse(os.path.exists(os.path.join(d, "none.csv")))

    def test_heterogeneous_pods_are_one_slow_and_one_small(self):
        import compare

        self.assertEqual(compare.heterogeneous_overrides(8, 2018), ["0:slowdown=2.0", "1:blocks=1009"])
        with self.assertRaises(ValueError):
            compare.heterogeneous_overrides(1, 100)

    def test_envoy_config_with_replicas_and_a_router_front(self):
        try:
            import yaml  # noqa: F401
        except ImportError:
            self.skipTest("PyYAML is not installed in this interpreter")
        from kvbench import systems

        pods = ["127.0.0.1:7001", "127.0.0.1:7002"]
        cfg = systems._envoy_config(REPO, 8000, 8001, pods, kvpick=[(9100, 9101), (9200, 9201), (9300, 9301)])
        clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
        kv = clusters["kvpick"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        self.assertEqual([e["endpoint"]["address"]["socket_address"]["port_value"] for e in kv], [9100, 9200, 9300])
        self.assertEqual([e["endpoint"]["health_check_config"]["port_value"] for e in kv], [9101, 9201, 9301])
        # Two streams per request (routing, observing): round robin would alias them.
        self.assertEqual(clusters["kvpick"].get("lb_policy"), "LEAST_REQUEST")
        pool = clusters["inference-pool-fallback"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        self.assertEqual([e["endpoint"]["address"]["socket_address"]["port_value"] for e in pool], [7001, 7002])
        filters = lambda c: [f["name"] for f in c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]]  # noqa: E731
        self.assertIn("envoy.filters.http.ext_proc", filters(cfg))
        self.assertIn("kvpick-observe", filters(cfg))
        front = systems._envoy_config(REPO, 8000, 8001, ["127.0.0.1:7100", "127.0.0.1:7200"])
        self.assertNotIn("envoy.filters.http.ext_proc", filters(front))
        self.assertNotIn("kvpick-observe", filters(front))
        fb = {c["name"]: c for c in front["static_resources"]["clusters"]}["inference-pool-fallback"]
        self.assertEqual(fb.get("lb_policy", "ROUND_ROBIN"), "ROUND_ROBIN")

    def test_the_one_filter_layout_sends_the_response_through_the_routing_filter(self):
        try:
            import yaml  # noqa: F401
        except ImportError:
            self.skipTest("PyYAML is not installed in this interpreter")
        from kvbench import systems

        def layout(responses):
            cfg = systems._envoy_config(REPO, 8000, 8001, ["127.0.0.1:7001"], kvpick=[(9100, 9101)],
                                        responses=responses)
            hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            by_name = {f["name"]: f for f in hcm["http_filters"]}
            routing = by_name["envoy.filters.http.ext_proc"]["typed_config"]["processing_mode"]
            return sorted(by_name), routing

        names, routing = layout("observe")
        self.assertIn("kvpick-observe", names)
        self.assertEqual(routing["response_body_mode"], "NONE")
        self.assertEqual(routing["response_header_mode"], "SKIP")
        names, routing = layout("routing")
        self.assertNotIn("kvpick-observe", names)
        self.assertEqual(routing["response_body_mode"], "FULL_DUPLEX_STREAMED")
        self.assertEqual(routing["response_header_mode"], "SEND")
        self.assertEqual(routing["response_trailer_mode"], "SEND")


class VllmRouterKvAwareTest(unittest.TestCase):
    """vllm-router 0.1.17's static --kv-event-source subscribes with topic "" and drops every
    message whose topic frame is not exactly "" (src/kv_index/subscriber.rs, spawn_inner), so
    its fleet must publish on vLLM's default, the empty topic: on the simulator's default
    llm-d topic every KV-index lookup missed (docs/benchmarks.md, "Side-by-side")."""

    def _args(self, **kw):
        import argparse

        base = dict(bin_dir="/bin", pods=2, block_size=16, time_scale=4.0, model="sim-model",
                    pod_override=None, heterogeneous=False)
        return argparse.Namespace(**{**base, **kw})

    def test_kv_aware_fleet_publishes_on_the_empty_topic_and_the_others_on_the_default(self):
        import compare
        from kvbench import systems

        self.assertEqual(systems.fleet_topic("vllm-router-kv-aware"), "")
        for name in systems.SYSTEMS:
            if name != "vllm-router-kv-aware":
                self.assertIsNone(systems.fleet_topic(name), name)
        argv = compare.sim_argv(self._args(), 100, 200, 300, 50, topic="")
        i = argv.index("--kv-events-topic")
        self.assertEqual(argv[i + 1], "")
        self.assertNotIn("--kv-events-topic", compare.sim_argv(self._args(), 100, 200, 300, 50))
        het = compare.sim_argv(self._args(heterogeneous=True, pod_override=["1:refuse=true"]), 100, 200, 300, 50)
        self.assertEqual(het[het.index("--pod-override"):],
                         ["--pod-override", "0:slowdown=2.0", "--pod-override", "1:blocks=25",
                          "--pod-override", "1:refuse=true"])

    def test_kv_aware_command_line_names_every_pod_its_block_size_and_model(self):
        from kvbench import systems

        fleet = systems.Fleet(2, 8100, 5557, 6557, "sim-model")
        argv = systems.vllm_router_argv("/venv/bin", fleet, "kv_aware", 9000, 9001, 16)
        pairs = [(argv[i], argv[i + 1]) for i in range(len(argv) - 1) if argv[i].startswith("--kv-event")]
        self.assertEqual(pairs, [
            ("--kv-event-source", "http://127.0.0.1:8100=tcp://127.0.0.1:5557"),
            ("--kv-event-replay-source", "http://127.0.0.1:8100=tcp://127.0.0.1:6557"),
            ("--kv-event-source", "http://127.0.0.1:8101=tcp://127.0.0.1:5558"),
            ("--kv-event-replay-source", "http://127.0.0.1:8101=tcp://127.0.0.1:6558"),
            ("--kv-event-block-size", "16"),
            ("--kv-event-model", "sim-model"),
        ])
        self.assertEqual(argv[argv.index("--policy") + 1], "kv_aware")
        cache_aware = systems.vllm_router_argv("/venv/bin", fleet, "cache_aware", 9000, 9001, 16)
        self.assertFalse([a for a in cache_aware if a.startswith("--kv-event")])

    def test_kv_lookups_are_read_from_the_router_metrics_by_result(self):
        text = "\n".join([
            "# TYPE vllm_router_kv_placement_lookups_total counter",
            'vllm_router_kv_placement_lookups_total{result="miss"} 3',
            'vllm_router_kv_placement_lookups_total{result="hit"} 6',
            'vllm_router_kv_routing_inputs_total{transport="http",result="render"} 9',
        ])
        self.assertEqual(stats.kv_lookups(text), {"miss": 3, "hit": 6})
        self.assertEqual(stats.kv_lookups("vllm_router_requests_total 4"), {})


class VllmRouterKvAwareLiveTest(unittest.TestCase):
    """The real vllm-router (the venv's, pinned) with kv_aware in front of one real kvpick-sim
    pod, both started as compare.py starts them: a shared prefix is a KV-index hit. Needs the
    simulator binary: KVPICK_BENCH_BIN_DIR (crates/kvpick-bench/tests/compare_smoke.rs sets
    it to the workspace's target/<profile>); skipped without it when run by hand."""

    def test_a_shared_prefix_hits_the_kv_index(self):
        import argparse
        import shutil
        import tempfile
        import urllib.request

        import compare
        from kvbench import systems
        from kvbench.procs import Procs, free_ports, http_get, wait_until

        bin_dir = os.environ.get("KVPICK_BENCH_BIN_DIR")
        router = os.path.join(os.path.dirname(sys.executable), "vllm-router")
        if not bin_dir or not os.path.isfile(router):
            self.skipTest("needs KVPICK_BENCH_BIN_DIR and the benchmark venv's vllm-router")
        args = argparse.Namespace(bin_dir=bin_dir, pods=1, block_size=16, time_scale=0.01,
                                  model="sim-model", pod_override=None, heterogeneous=False)
        http, events, replay, port, prom = free_ports(5)
        fleet = systems.Fleet(1, http, events, replay, args.model)
        log_dir = tempfile.mkdtemp(prefix="kvbench-live-")
        procs = Procs(log_dir)
        passed = False
        try:
            procs.start("kvpick-sim", compare.sim_argv(args, http, events, replay, 256,
                                                       systems.fleet_topic("vllm-router-kv-aware")))
            wait_until("pod", lambda: http_get(f"{fleet.urls()[0]}/health")[0] == 200, procs, timeout=30)
            procs.start("vllm-router", systems.vllm_router_argv(
                os.path.dirname(sys.executable), fleet, "kv_aware", port, prom, args.block_size))
            wait_until("vllm-router", lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200,
                       procs, timeout=30)
            doc = " ".join(f"Sentence {i} of the shared document." for i in range(40))
            lookups = {}
            # Each request is the shared document plus a question of its own, so each one
            # fills new blocks and publishes: the first BlockStored may go out before the
            # router's SUB has joined (a PUB drops it), the next one's seq gap makes the router
            # replay it. Bounded.
            for i in range(20):
                prompt = f"{doc} Question {i}: " + " ".join(f"word{i}x{j}" for j in range(24))
                body = json.dumps({"model": args.model, "max_tokens": 1, "prompt": prompt}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    self.assertEqual(r.status, 200)
                lookups = stats.kv_lookups(http_get(f"http://127.0.0.1:{prom}/metrics")[1])
                if lookups.get("hit"):
                    break
            self.assertGreater(lookups.get("hit", 0), 0,
                               f"vllm-router KV-index lookups: {lookups}; logs in {log_dir}")
            passed = True
        finally:
            procs.stop_all()
            if passed:  # a failure keeps the two processes' logs
                shutil.rmtree(log_dir, ignore_errors=True)


class CopiesTest(unittest.TestCase):
    """bench/copies.py on a run directory written here: a group's first prefill, a hit, a copy
    (matched to the decision kvpick logged for it), another group's first prefill and its
    prefill again on the same pod."""

    def test_full_prefills_are_told_apart_and_a_copy_gets_its_decision(self):
        import io
        import tempfile

        with tempfile.TemporaryDirectory() as run:
            d = os.path.join(run, "kvpick-recommended")
            os.makedirs(d)
            rows = [
                # arrived, pod, group, cached
                (1000.0, 0, "aaaa", 0),
                (1001.0, 0, "aaaa", 2000),
                (1002.0, 1, "aaaa", 0),
                (1003.0, 1, "bbbb", 100),
                (1004.0, 1, "bbbb", 0),
            ]
            with open(os.path.join(d, "requests.jsonl"), "w") as f:
                for arrived, pod, head, cached in rows:
                    f.write(json.dumps({"pod": pod, "arrived": arrived, "first_token_s": 0.5, "prompt_tokens": 2200,
                                        "cached_tokens": cached, "head": head, "head_long": head,
                                        "reusable_tokens": 0, "floor_s": 0.46}) + "\n")
            with open(os.path.join(d, "pool.yaml"), "w") as f:
                f.write("endpoints:\n  - address: 127.0.0.1:21000\n    kvEvents: tcp://x\n  - address: 127.0.0.1:21001\n")
            os.makedirs(os.path.join(d, "logs"))

            def decision(at, costs):
                stamp = datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                parts = "".join(
                    f"127.0.0.1:2100{i} cost={cost} ttft={cost} decode=5 evict=0 holdup=7 cached={cached} "
                    f"backlog={backlog} awaiting=1 waiting=0 (own 0) in_flight=2; "
                    for i, (cost, cached, backlog) in enumerate(costs))
                return f"{stamp} DEBUG kvpick::scheduling::placement: placement costs prompt=2200.0 candidates={parts}\n"

            with open(os.path.join(d, "logs", "kvpick.log"), "w") as f:
                f.write("2026-12-08T01:00:00.000000Z INFO kvpick: listening\n")
                # Before the copy's arrival window, and one whose cheapest is the holder.
                f.write(decision(1001.01, [(100, 2000, 0), (400, 0, 0)]))
                f.write(decision(1002.01, [(900, 2000, 2200), (450, 0, 0)]))
            out = io.StringIO()
            copies.report(d, out=out)
            lines = out.getvalue().splitlines()
        self.assertEqual(lines[0], "kvpick-recommended: 4 full prefills, 1 copies")
        self.assertIn("pod 0 prefix aaaa first", lines[1])
        self.assertIn("pod 1 prefix aaaa copy", lines[2])
        self.assertIn("(held on 0)", lines[2])
        # The picked pod first, then the others by cost.
        self.assertEqual(lines[3].strip(), "1:450/450/5/7/0/0/1 0:900/900/5/7/2000/2200/1")
        self.assertIn("pod 1 prefix bbbb first", lines[4])
        self.assertIn("pod 1 prefix bbbb again", lines[5])
        self.assertEqual(len(lines), 6)

    def test_a_multi_turn_run_counts_conversations_as_the_comparison_does(self):
        import io
        import tempfile

        with tempfile.TemporaryDirectory() as run:
            d = os.path.join(run, "smg-cache-aware")
            os.makedirs(d)
            # Two conversations behind one shared preamble (one `head`), each new on its pod.
            with open(os.path.join(d, "requests.jsonl"), "w") as f:
                for arrived, pod, head_long in ((1000.0, 0, "conv1"), (1001.0, 1, "conv2")):
                    f.write(json.dumps({"pod": pod, "arrived": arrived, "first_token_s": 0.5, "prompt_tokens": 500,
                                        "cached_tokens": 0, "head": "pre", "head_long": head_long}) + "\n")

            def report_lines():
                out = io.StringIO()
                copies.report(d, out=out)
                return out.getvalue().splitlines()

            # No summary.json: prefixes are groups, so the second conversation is a copy.
            self.assertEqual(report_lines()[0], "smg-cache-aware: 2 full prefills, 1 copies")
            with open(os.path.join(run, "summary.json"), "w") as f:
                json.dump({"workload": {"kind": "multi-turn"}}, f)
            lines = report_lines()
        self.assertEqual(lines[0], "smg-cache-aware: 2 full prefills, 0 copies")
        self.assertIn("pod 1 prefix conv2 first", lines[2])


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
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 7\n'
            "garbage line without value\n"
        )
        pod_b = (
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600\n'
            'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2\n'
        )
        a, b = stats.pod_counters(pod_a), stats.pod_counters(pod_b)
        self.assertEqual((a["prefix_hits"], a["prefix_queries"], a["finished"]), (300, 400, 6))
        self.assertEqual((a["waiting"], a["running"], b["waiting"]), (3, 7, 0))
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

    def test_placement_summary_counts_copies_moves_and_repeat_misses(self):
        def rec(t, pod, head, cached, prompt=100, head_long=None):
            return {"arrived": t, "pod": pod, "head": head, "head_long": head_long or head,
                    "cached_tokens": cached, "prompt_tokens": prompt}
        records = [
            rec(3.0, 1, "a", 90),   # a moves 0 → 1, still a hit
            rec(1.0, 0, "a", 0),    # out of order on purpose: sorted by arrival
            rec(2.0, 0, "b", 0),
            rec(4.0, 0, "b", 10),   # b repeats on its pod but was evicted: a repeat miss
            rec(5.0, 1, "c", 0),    # c once: not counted in copies
            rec(6.0, 0, "a", 20, head_long="a2"),  # a back on 0, a miss
        ]
        got = stats.placement_summary(records)
        self.assertEqual(got["prefixes"], 3)
        self.assertAlmostEqual(got["copies_per_prefix"], (2 + 1) / 2)
        self.assertEqual(got["prefix_moves"], 2)
        self.assertEqual(got["repeat_requests"], 3)
        self.assertEqual(got["repeat_misses"], 2)
        by_long = stats.placement_summary(records, key="head_long")
        self.assertEqual(by_long["prefixes"], 4)
        self.assertEqual(stats.placement_summary([])["copies_per_prefix"], None)
        table = report.placement_table([{"system": "x", "placement": got}, {"system": "y"}])
        self.assertIn("| x | 3 | 1.50 | 2 | 2/3 | 0 (0) | 0 |", table)
        self.assertNotIn("| y |", table)

    def test_placement_summary_counts_requests_queued_behind_a_prefill(self):
        def rec(t, pod, ttft):
            return {"arrived": t, "pod": pod, "head": f"h{t}", "head_long": f"h{t}",
                    "cached_tokens": 0, "prompt_tokens": 100, "first_token_s": ttft}
        records = [
            rec(0.0, 0, 0.5),   # pod 0 prefills until 0.5
            rec(0.1, 0, 0.6),   # behind it while pod 1 has nothing: avoidable
            rec(0.2, 1, 0.5),   # pod 1 prefills until 0.7
            rec(0.3, 1, 0.5),   # behind on 1, and pod 0 still busy: not avoidable
            rec(0.8, 0, 0.1),   # both pods done (first tokens at 0.5, 0.7 and 0.7, 0.8)
            {"arrived": 0.85, "pod": 0, "head": "f", "head_long": "f",
             "cached_tokens": 0, "prompt_tokens": 100},  # behind, pod 1 free; failed: adds none
            rec(0.86, 0, 0.1),  # behind the one at 0.8 only, pod 1 free: avoidable
        ]
        got = stats.placement_summary(records)
        self.assertEqual(got["behind_prefill"], 4)
        self.assertEqual(got["behind_prefill_avoidable"], 3)

    def test_placement_summary_counts_requests_piled_onto_one_pod(self):
        def rec(t, pod):
            return {"arrived": t, "pod": pod, "head": f"h{t}", "head_long": f"h{t}",
                    "cached_tokens": 0, "prompt_tokens": 100, "first_token_s": 0.1}
        records = [
            rec(1.000, 0), rec(1.005, 0), rec(1.010, 0),  # a third within 20 ms: piled
            rec(1.015, 0),                                # and a fourth (last two 1.005, 1.010)
            rec(1.012, 1), rec(1.013, 1),                 # two on pod 1: not a pile
            rec(2.000, 0), rec(2.010, 0), rec(2.030, 0),  # the third 30 ms after the first
        ]
        self.assertEqual(stats.placement_summary(records)["piled"], 2)

    def test_stage_pod_times_split_the_log_by_stage_with_its_floors(self):
        def rec(t, ttft, floor):
            return {"arrived": t, "pod": 0, "head": "h", "head_long": "h", "cached_tokens": 0,
                    "prompt_tokens": 100, "first_token_s": ttft, "floor_s": floor}
        # Out of order in the file: the split is by arrival. Stage 0 has 2 requests, stage 1 has 3.
        records = [rec(5.0, 0.3, 0.1), rec(1.0, 0.2, 0.2), rec(2.0, 0.4, 0.3),
                   rec(6.0, 0.1, 0.05), rec(7.0, 0.2, 0.05)]
        got = stats.stage_pod_times(records, [2, 3])
        self.assertAlmostEqual(got[0]["pod_ttft_mean"], 0.3)
        self.assertAlmostEqual(got[0]["floor_mean"], 0.25)
        self.assertAlmostEqual(got[1]["pod_ttft_mean"], 0.2)
        self.assertAlmostEqual(got[1]["pod_ttft_p90"], stats.percentile([0.3, 0.1, 0.2], 90))
        self.assertAlmostEqual(got[1]["floor_p90"], stats.percentile([0.1, 0.05, 0.05], 90))
        # A line short (a request failed before its first token): no split at all.
        self.assertEqual(stats.stage_pod_times(records[:4], [2, 3]), [None, None])
        # A line without a floor (an older simulator): the pods' times, no floor.
        older = [dict(r) for r in records]
        del older[3]["floor_s"]
        got = stats.stage_pod_times(older, [2, 3])
        self.assertIsNone(got[1]["floor_mean"])
        self.assertAlmostEqual(got[0]["floor_mean"], 0.25)
        rows = [{"system": "x", "rate": 4.0, "ttft_mean": 0.35, "ttft_p90": 0.5, **got[0]},
                {"system": "y", "rate": 4.0, "ttft_mean": 0.3, "ttft_p90": 0.4, "pod_ttft_mean": None}]
        table = report.ttft_split_table(rows)
        self.assertIn("| x | 4.0 | 350 / 500 | 300 / 380 | 50.0 | 250 / 290 |", table)
        self.assertNotIn("| y |", table)

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


class InferencePerfPatchesTest(unittest.TestCase):
    """bench/ipf_seeded.py's patches, on inference-perf's real data generators."""

    def _tokenizer(self):
        try:
            from inference_perf.config import CustomTokenizerConfig
            from inference_perf.utils.custom_tokenizer import CustomTokenizer
        except ImportError:
            self.skipTest("inference-perf is not installed in this interpreter")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return CustomTokenizer(CustomTokenizerConfig(pretrained_model_name_or_path=os.path.join(REPO, "assets/tokenizer")))

    def test_shifted_shared_prefix_data_serves_the_chosen_groups(self):
        tok = self._tokenizer()
        from inference_perf.apis.base import LazyLoadInferenceAPIData
        from inference_perf.config import APIConfig, DataConfig
        from inference_perf.datagen.synthetic.shared_prefix_datagen import SharedPrefixDataGenerator
        import ipf_seeded

        w = Workload(kind="shifting", groups=8, prompts_per_group=2, system_len=32, question_len=8, output_len=4,
                     hot_fraction=0.25, hot_share=1.0, rates=[10.0], stage_seconds=4)
        data = inference_perf_config(w, "u", "m", "/t", "/o")["data"]
        gen = SharedPrefixDataGenerator(APIConfig(), DataConfig(**data), tok)
        ipf_seeded.install_shifting(shifting_spec(w))
        ipf_seeded.install_shifting(shifting_spec(w))  # idempotent
        prefix_group = {gen.prefix_texts[i]: gen.prompt_groups[i] for i in range(len(gen.prompts))}

        def served_group(i):
            prompt = gen.load_lazy_data(LazyLoadInferenceAPIData(data_index=i, stage_id=0)).prompt
            return next(g for p, g in prefix_group.items() if prompt.startswith(p))

        # hot_share 1: the first 20 requests ask groups {0, 1}, the last 20 groups {2, 3}.
        self.assertEqual({served_group(i) for i in range(20)}, {0, 1})
        self.assertEqual({served_group(i) for i in range(20, 40)}, {2, 3})

    def test_re_primed_conversations_keep_their_system_prompt(self):
        tok = self._tokenizer()
        from inference_perf.apis.base import LazyLoadInferenceAPIData
        from inference_perf.apis.user_session import LocalUserSession
        from inference_perf.config import APIConfig, DataConfig
        from inference_perf.datagen.replay.conversation_replay_datagen import ConversationReplayDataGenerator
        import ipf_seeded

        ipf_seeded.install_session_fix()
        ipf_seeded.install_conversation_shuffle()
        w = Workload(kind="multi-turn", conversations=2, turns=3, shared_len=16, system_len=24, question_len=8, output_len=4)
        data = inference_perf_config(w, "u", "m", "/t", "/o")["data"]
        gen = ConversationReplayDataGenerator(APIConfig(), DataConfig(**data), tok)
        # What inference-perf does between stages; the next stage's first turn re-primes.
        LocalUserSession.clear_instances()
        item = gen.load_lazy_data(LazyLoadInferenceAPIData(data_index=0, stage_id=1))
        session = LocalUserSession.get_instance(item.user_session_id)
        self.assertTrue(session.system_prompt)
        self.assertEqual(session.system_prompt, session.context)
        body = asyncio.run(item.to_request_body("m", 4, True, False))
        prompt = body.data["prompt"] if hasattr(body, "data") else item.prompt
        # The turn carries the system prompt, not only the turn's own question.
        self.assertTrue(prompt.startswith(session.system_prompt[:40]), prompt[:80])
        self.assertGreater(tok.count_tokens(prompt), 16 + 24)


if __name__ == "__main__":
    unittest.main()
