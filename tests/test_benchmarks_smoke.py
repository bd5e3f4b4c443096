"""The benchmarks and the demo still run end to end (tiny sizes). Speed is never asserted here: it lives
in the benchmarks' own output, measured side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from benchmarks import netns

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=280, cwd=REPO)


def test_bench_runs_every_mode_and_writes_json_and_plot(tmp_path: Path) -> None:
    # two sizes: no receiver may build the second size's model (or exit) while a push is timed;
    # the bench checks every receiver's word on when it built each (check_gated) before writing
    out = run("-m", "benchmarks.push_vs_broadcast", "--sizes", "4,8", "--subscribers", "1", "--reps", "1",
              "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a target missed at this toy size
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    report = msgspec.json.decode((tmp_path / "bench.json").read_bytes())
    modes = {row["mode"] for row in report["rows"]}
    assert modes == {"naive", "packed", "ws_copy", "ws_after", "ws_assign", "ws_nocrc", "ws_nocopy", "ws_ahead"}
    assert sorted({round(row["mib"]) for row in report["rows"]}) == [4, 8]
    assert all(row["to_all_ms"] > 0 and row["stall_ms"] >= 0 for row in report["rows"])
    assert all(len(row["to_all_runs_ms"]) == len(row["stall_runs_ms"]) == 1 for row in report["rows"])
    # weightsync's rows carry the acknowledgement time beside the time to the generators' model tensors
    # (which comes later in truth; the two are stamped on different threads and processes, so their
    # order is not asserted: a wall-clock claim at an 8 MiB toy size)
    assert all(row["acked_ms"] > 0 for row in report["rows"] if row["mode"].startswith("ws"))
    assert all(row["acked_ms"] == 0 for row in report["rows"] if not row["mode"].startswith("ws"))
    assert report["ceiling"]["memcpy_gbps"] > 0 and report["ceiling"]["loopback_gbps"] > 0
    # which CPU, and whether glibc's copies were tuned: both change the figures (docs/benchmarks.md)
    assert report["cpu"] and report["glibc_tunables"] == os.environ.get("GLIBC_TUNABLES", "")
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "PASS" in out.stdout or "FAIL" in out.stdout


def test_bench_times_every_mode_in_each_round_side_by_side() -> None:
    """Every round pushes once in every mode, in the same order in every run: no mode is timed
    minutes apart from the others, and none always follows the same one."""
    from benchmarks.push_vs_broadcast import MODES, rounds

    order = rounds(3)
    assert len(order) == 4  # a warm-up round, then 3 measured
    assert all(sorted(r) == sorted(MODES) for r in order)
    assert order == rounds(3)
    pushes = [m for r in order for m in r]
    before = {m: {pushes[i - 1] for i in range(1, len(pushes)) if pushes[i] == m} for m in MODES}
    assert all(len(b) > 1 for b in before.values())


@pytest.mark.netns
@pytest.mark.skipif(netns.unavailable() is not None, reason=f"no network namespaces here: {netns.unavailable()}")
def test_bench_runs_every_contender_with_generators_on_emulated_hosts(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.push_vs_broadcast", "--sizes", "8", "--subscribers", "2", "--reps", "1",
              "--link-mbit", "2000", "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a target missed at this toy size
    report = msgspec.json.decode((tmp_path / "bench.json").read_bytes())
    assert report["link_mbit"] == 2000 and report["transport"] == "group"
    assert {(row["mode"], row["subscribers"]) for row in report["rows"]} == {
        (mode, 2) for mode in ("naive", "packed", "ws_copy", "ws_after", "ws_assign", "ws_nocrc", "ws_nocopy",
                               "ws_ahead")}
    # 8 MiB to each of two hosts behind 2000 Mbit/s links: no contender can beat the wire (33 ms)
    assert all(row["to_all_ms"] > 30 for row in report["rows"])
    # the bench took its hosts down with it: no namespace is left whose owner is gone
    owners = {int(m.group(1)) for m in map(netns.NS_RE.match, netns.namespaces()) if m}
    assert all(netns._alive(pid) for pid in owners), owners


def test_same_host_bench_runs_both_transports_and_both_pipelines(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.same_host", "--sizes", "8", "--subscribers", "1", "--reps", "1", "--pipeline", "both",
              "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a target missed at this toy size
    report = msgspec.json.decode((tmp_path / "same_host.json").read_bytes())
    kinds = {(p["transport"], p["checksum"], p["pipeline"]) for p in report["points"]}
    assert kinds == {(t, c, pipe) for t in ("shm", "group") for c in (True, False) for pipe in (True, False)}
    assert all(p["to_all_ms"] > 0 and p["put_ms"] > 0 for p in report["points"])
    assert report["memcpy_gbps"] > 0 and (tmp_path / "same_host.png").stat().st_size > 10_000


def test_cpu_profile_reads_every_thread_of_every_process_by_name(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.cpu_profile", "--mib", "16", "--subscribers", "2", "--versions", "1",
              "--bucket-mib", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    profiles = {p["mode"]: p for p in msgspec.json.decode((tmp_path / "cpu_profile.json").read_bytes())["profiles"]}
    assert list(profiles) == ["naive", "ws_copy", "ws_assign", "ws_nocrc"]
    for mode, p in profiles.items():
        assert list(p["cpu_ms"]) == ["trainer", "generator 1", "generator 2"] and p["to_all_ms"] > 0
        assert p["bucket_mib"] == 4  # the publisher's buckets, recorded with the figures they gave
        assert all("gloo_tcp_loop" in threads for threads in p["cpu_ms"].values())
        # weightsync's threads carry their names at the OS level: the receivers and the trainer's snapshot
        named = {name for threads in p["cpu_ms"].values() for name in threads if name.startswith("ws-p-")}
        assert ({"ws-p-receiver", "ws-p-snapshot", "ws-p-sender"} <= named) is (mode != "naive"), (mode, named)
    assert (tmp_path / "cpu_profile.png").stat().st_size > 10_000


def test_cast_bench_pushes_fp32_masters_as_bf16_in_every_mode(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.cast", "--mib", "4", "--subscribers", "1", "--reps", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["mode"]: r for r in msgspec.json.decode((tmp_path / "cast.json").read_bytes())["rows"]}
    assert list(rows) == ["fp32", "caller_bf16", "dtype", "dtype_nocopy"]
    half = rows["fp32"]["wire_mib"] / 2  # every bf16 mode sends half the fp32 bytes (give or take alignment)
    assert all(abs(rows[m]["wire_mib"] - half) < 0.01 for m in ("caller_bf16", "dtype", "dtype_nocopy"))
    assert all(r["stall_ms"] > 0 and r["to_all_ms"] > 0 for r in rows.values())
    assert (tmp_path / "cast.png").stat().st_size > 10_000


def test_train_loop_and_recorder_overhead_run(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.train_loop", "--mib", "8", "--steps", "2", "--step-ms", "20", "--subscribers", "1",
              "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    loop = msgspec.json.decode((tmp_path / "train_loop.json").read_bytes())
    assert [r["method"] for r in loop["results"]] == ["packed", "ws_copy", "ws_nocopy"]
    out = run("-m", "benchmarks.recorder_overhead", "--mib", "8", "--reps", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    overhead = msgspec.json.decode((tmp_path / "recorder_overhead.json").read_bytes())
    assert overhead["entries_per_push"] > 0 and overhead["seconds_per_entry"] > 0


def test_gpu_snapshot_says_so_without_cuda_and_draws_a_device_runs_json(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.gpu_snapshot", "--gb", "0.1")
    assert out.returncode == 0
    assert "no CUDA" in out.stdout or "GB bf16" in out.stdout
    from benchmarks import gpu_snapshot

    shape = gpu_snapshot.GpuResult(device="none", gb=1.0, backend="nccl", put_stall_ms=[1.0], snapshot_done_ms=[7.0],
                                   device_copy_ms=[6.5], stall_vs_device_copy=0.15, device_copy_gbps=150.0,
                                   pinned_h2d_gbps=50.0, pageable_h2d_gbps=20.0, torch="", when="")
    (tmp_path / "run.json").write_bytes(msgspec.json.encode(shape))
    out = run("-m", "benchmarks.gpu_snapshot", "--plot-from", str(tmp_path / "run.json"), "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "gpu_snapshot.png").stat().st_size > 10_000


def test_gpu_delta_without_cuda_says_so_and_draws_a_run_from_its_json(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.gpu_delta", "--mib", "8")
    assert out.returncode == 0 and "no CUDA" in out.stdout, out.stderr[-3000:]
    # the host side of the benchmark, measured here, stands in for both sides of a device run's JSON
    from benchmarks import gpu_delta

    manifest, base, cur = gpu_delta.version_pair(130, 0.03, "cpu")  # two whole buckets and a part
    host = gpu_delta.side(manifest, base, cur, reps=1)
    assert 0 < host.wire_bytes < manifest.total_bytes * 0.05 and len(host.encode_ms) == 1
    result = gpu_delta.GpuDelta(device="none", cpu="here", cpu_threads=1, mib=130, changed=0.03, cuda=host,
                                host=host, encode_host_over_cuda=1.0, decode_host_over_cuda=1.0, torch="", when="")
    (tmp_path / "gpu_delta.json").write_bytes(msgspec.json.encode(result))
    out = run("-m", "benchmarks.gpu_delta", "--plot-from", str(tmp_path / "gpu_delta.json"), "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "gpu_delta.png").stat().st_size > 10_000


def test_generations_benchmark_runs(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.generations", "--cycles", "2", "--members", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = msgspec.json.decode((tmp_path / "generations.json").read_bytes())
    assert all(r["join_ms"] > 0 and r["leave_ms"] > 0 and len(r["joins"]) == 2 for r in report["results"])
    assert (tmp_path / "generations.png").stat().st_size > 10_000


def test_checksums_bench_measures_every_digest_in_cache_and_as_a_transfer_hands_a_bucket_over(
        tmp_path: Path) -> None:
    out = run("-m", "benchmarks.checksums", "--mib", "4", "--reps", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = msgspec.json.decode((tmp_path / "checksums.json").read_bytes())
    assert report["chosen"] in ("crc32c", "xxh3")
    assert all(gbs > 0 for gbs in [*report["gb_per_s"].values(), *report["into_gb_per_s"].values()])
    fresh = report["fresh_gb_per_s"]
    assert "written just before, this thread" in fresh and "cold (a bigger buffer written since)" in fresh
    assert all(gbs > 0 for gbs in fresh.values())
    assert (tmp_path / "checksums.png").stat().st_size > 10_000


def test_codec_bench_times_both_implementations_beside_their_ceilings(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.codec", "--mib", "8", "--reps", "1", "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stdout[-2000:] + out.stderr[-2000:]  # 1: a speed target missed
    report = msgspec.json.decode((tmp_path / "codec.json").read_bytes())
    names = {r["what"] for r in report["rates"]}
    assert {"encode, numpy", "decode, numpy", "encode, torch", "decode, torch"} <= names
    assert any("ceiling" in n for n in names) and all(r["gbps"] > 0 for r in report["rates"])
    assert 0.02 < report["changed"] < 0.05 and 0 < report["wire_bytes_per_changed"] < 2
    assert (tmp_path / "codec.png").stat().st_size > 10_000


def test_gloo_wire_bench_measures_every_point_on_both_ends(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.gloo_wire", "--mib", "8", "--buckets", "4,1", "--streams", "1,2", "--reps", "2",
              "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = msgspec.json.decode((tmp_path / "gloo_wire.json").read_bytes())
    points = {(p["streams"], p["bucket_mib"]): p for p in report["points"]}
    assert set(points) == {(1, 4), (1, 1), (2, 4), (2, 1)}
    for p in points.values():  # the receiver's CPU came back from its own process, every rep timed
        assert p["gb_per_s"] > 0 and p["sender_cpu_ms_per_gb"] > 0 and p["receiver_cpu_ms_per_gb"] > 0
        assert len(p["runs_s"]) == 2
    assert "time / 1 stream" in out.stdout
    assert (tmp_path / "gloo_wire.png").stat().st_size > 10_000


def test_floor_bench_times_every_mode_to_the_receivers_last_byte(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.floor", "--mib", "8", "--generators", "2", "--bucket-mib", "1", "--reps", "2",
              "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = msgspec.json.decode((tmp_path / "floor.json").read_bytes())
    modes = {m["mode"]: m for m in report["modes"]}
    assert list(modes) == ["naive", "wire", "wire+digest", "snapshot+wire", "snapshot+wire+digest"]
    assert modes["naive"]["ratio_to_naive"] == 1.0
    for m in modes.values():  # each rep timed on the host's one clock, the receiver's CPU from its own process
        assert len(m["runs_ms"]) == 2 and all(ms > 0 for ms in m["runs_ms"])
        assert m["sender_cpu_ms"] > 0 and m["receiver_cpu_ms"] > 0
        assert m["ratio_to_naive"] == pytest.approx(m["to_all_ms"] / modes["naive"]["to_all_ms"])
    assert report["digest"] in ("crc32c", "xxh3") and report["tensors"] > 1 and report["generators"] == 2
    assert "snapshot+wire+digest" in out.stdout and "/ naive" in out.stdout
    assert (tmp_path / "floor.png").stat().st_size > 10_000


def test_floor_bench_refuses_nonsense(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.floor", "--reps", "0", "--out", str(tmp_path))
    assert out.returncode == 2 and "must be >= 1" in out.stderr


def test_gloo_wire_bench_refuses_a_bucket_larger_than_the_buffer(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.gloo_wire", "--mib", "4", "--buckets", "8", "--out", str(tmp_path))
    assert out.returncode == 2 and "larger than --mib" in out.stderr


def test_the_minimal_push_example_ends_bit_exact() -> None:
    out = run("-m", "rl_examples.minimal_push", "--steps", "3", "--generators", "2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "every generator ended on the trainer's latest weights" in out.stdout


def test_cost_model_tree_is_gloos_binomial_broadcast_and_its_wire_term_adds_up() -> None:
    from benchmarks.cost_model import tree, wire_seconds

    # gloo's broadcast: a rank gets the data from itself without its highest set bit
    assert tree(1) == {1: 0}
    assert tree(4) == {1: 0, 2: 0, 3: 1, 4: 0}
    assert tree(8) == {1: 0, 2: 0, 3: 1, 4: 0, 5: 1, 6: 2, 7: 3, 8: 0}
    s, b, r = 8e6, 2e6, 1e8  # bytes, bytes, bit/s
    one = s * 8 / r
    assert wire_seconds(1, int(s), int(b), r) == pytest.approx(one)
    assert wire_seconds(2, int(s), int(b), r) == pytest.approx(one)  # the root's sends run side by side
    # 4 receivers: rank 3 is one relay away, one extra bucket of pipeline fill
    assert wire_seconds(4, int(s), int(b), r) == pytest.approx(one + b * 8 / r)
    # 8: rank 1 relays to 3 and 5 over one outgoing link (half rate each), then 3 -> 7
    assert wire_seconds(8, int(s), int(b), r) == pytest.approx(2 * one + 2 * b * 8 / r)
    # a shaped root shares its link among its ceil(log2(n + 1)) children
    assert wire_seconds(2, int(s), int(b), r, root_bps=r) == pytest.approx(2 * one)


def test_cost_model_lanes_count_what_each_generator_relays_in_every_lane() -> None:
    from benchmarks.cost_model import lane_seconds, uplinks

    # of 8, rank 1 forwards to 3 and 5: two versions' worth with one lane, or with lanes in one order
    assert uplinks(8, 1) == uplinks(8, 2, rotate=False) == uplinks(8, 4, rotate=False) == pytest.approx(2.0)
    assert uplinks(8, 2) == pytest.approx(1.0) and uplinks(8, 4) == pytest.approx(0.75)  # lanes take turns
    assert uplinks(2, 4) == 0.0  # two generators: both hear from the root, nobody relays
    s, b, r = 8e6, 2e6, 1e8
    one, fill = s * 8 / r, 2 * b * 8 / r  # of 8, the deepest path (0-1-3-7) has two hops past the first
    assert lane_seconds(8, 2, int(s), int(b), r, rotate=False) == pytest.approx(2 * one + fill)
    assert lane_seconds(8, 2, int(s), int(b), r) == pytest.approx(one + fill)  # the downlink sets the pace
    assert lane_seconds(8, 8, int(s), int(b), r) == pytest.approx(one + 2 * (s / 8) * 8 / r)  # a lane < a bucket
    # one lane from a trainer whose own link is the limit: its 2 children share it
    assert lane_seconds(2, 1, int(s), int(b), r, trainer_bps=r) == pytest.approx(2 * one)


def test_cost_model_projection_counts_every_connection_of_a_pair() -> None:
    from benchmarks.cost_model import project

    # one stream at 28.6 Gb/s, a 100 Gb/s NIC at eta 1: one sender's hop is its connections' sum
    one, two = (project(1.0, 0.0, 0.0, 28.6e9, streams) for streams in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert b.hop_gbit == pytest.approx(min(a.nic_gbit, 2 * 28.6)) and a.hop_gbit == pytest.approx(28.6)
        assert b.seconds < a.seconds and b.lanes["256"] <= a.lanes["256"]


def test_sliced_model_fits_its_own_terms_back_and_projects_each_receivers_share() -> None:
    """issue 58: the sliced receivers' model, fitted on points it made itself (a, eta, c0, k
    known), predicts them back; the 1T projection charges each generator GPU its share and each
    trainer GPU its lane's share for every engine."""
    from benchmarks import sliced_model as m

    points = [m.Point(w, rate, mib, mib * 2**19, 0.0, []) for w in (1, 2) for rate in (100.0, 300.0, 1000.0)
              for mib in (16.0, 48.0)]
    for p in points:
        p.seconds = m.predict(p, 0.03, 0.9, 0.01, 2e-9)
    result = m.analyse(points, [("*", "300", "*")])
    assert result.worst_held_out < 0.02, result.worst_held_out
    rows = {(j.weights, j.encoding, j.layout): j for j in result.projections}
    assert len(rows) == 8
    full, wide = rows[("bf16", "full", "16 x TP=8")], rows[("bf16", "full", "1 x EP=128")]
    assert full.version_gb == 2000 and full.generator_gb == 250 and full.trainer_gb == pytest.approx(125)
    assert wide.generator_gb == pytest.approx(2000 / 128) and wide.seconds < full.seconds
    assert rows[("fp8-block", "full", "16 x TP=8")].generator_gb == pytest.approx(2000 * 0.5001 / 8)
    assert rows[("bf16", "delta", "16 x TP=8")].codec_s > 0 == rows[("bf16", "full", "16 x TP=8")].codec_s


@pytest.mark.netns
@pytest.mark.skipif(netns.unavailable() is not None, reason=f"no network namespaces here: {netns.unavailable()}")
def test_sliced_model_measures_lanes_into_sliced_receivers_behind_shaped_links(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.sliced_model", "--ranks", "2", "--rates", "300", "--sizes", "4", "--versions", "1",
              "--hold-out", "", "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stdout[-2000:] + out.stderr[-3000:]
    result = msgspec.json.decode((tmp_path / "sliced_model.json").read_bytes())
    (point,) = result["points"]
    assert point["ranks"] == 2 and 0.45 < point["share_bytes"] / 2**22 < 0.55  # its half of 4 MiB
    assert point["seconds"] > point["share_bytes"] * 8 / 300e6  # no faster than its link
    assert (tmp_path / "sliced_model.png").exists()


def test_sharded_bench_runs_every_mode_and_measures_every_rank(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.sharded", "--mib", "4", "--ranks", "1", "2", "--versions", "1", "--bucket-mib", "1",
              "--sliced", "--delta", "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stdout[-2000:] + out.stderr[-3000:]  # 1: a target missed at this toy size
    report = msgspec.json.decode((tmp_path / "sharded.json").read_bytes())
    kinds = {(p["world"], p["mode"]) for p in report["points"]}
    assert kinds == {(w, m) for w in (1, 2) for m in ("sharded", "gather", "sliced", "sliced-delta")}
    for point in report["points"]:
        assert point["delivery_s"] > 0 and len(point["peak_extra_bytes"]) == point["world"]
        assert sum(point["local_bytes"]) >= 4 << 20
        got, model = point["received_bytes_per_generator"], sum(point["local_bytes"])
        if point["mode"] == "sliced":  # the two TP ranks split every tensor (unevenly): each byte once
            assert sum(got) == model and max(got) < 0.55 * model, point
        elif point["mode"] == "sliced-delta":  # one element in 33 moved: each TP rank is sent a delta of its half
            assert 0 < sum(got) < 0.2 * model, point
        else:
            assert got == [model, model], point
    assert (tmp_path / "sharded.png").stat().st_size > 10_000


def test_revisions_compares_a_benchmarks_ratios_at_two_revisions(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.revisions", "--base", "HEAD", "--rounds", "1", "--out", str(tmp_path), "same_host",
              "--sizes", "8", "--subscribers", "1", "--reps", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    report = msgspec.json.decode((tmp_path / "revisions-same_host.json").read_bytes())
    assert report["head_over_base"] and all(v > 0 for v in report["head_over_base"].values())
    assert set(report["base_ratios"]) == set(report["head_ratios"])
    assert (tmp_path / "revisions-same_host.png").stat().st_size > 10_000


def test_activation_bench_measures_both_modes(tmp_path: Path) -> None:
    out = run("-m", "benchmarks.activation", "--mib", "2", "--versions", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    report = msgspec.json.decode((tmp_path / "activation.json").read_bytes())
    assert [r["activation"] for r in report] == ["each", "all"]
    assert all(len(r["spread_ms"]) == 2 and len(r["recorded_spread_ms"]) == 2 for r in report)
    assert (tmp_path / "activation.png").stat().st_size > 10_000


@pytest.mark.netns
def test_lanes_bench_measures_both_orders_on_the_emulated_cluster(tmp_path: Path) -> None:
    from benchmarks import netns  # noqa: PLC0415 - only here

    if netns.unavailable():
        pytest.skip(f"no emulated cluster here: {netns.unavailable()}")
    out = run("-m", "benchmarks.lanes", "--lanes", "2", "--generators", "3", "--mib", "2", "--reps", "1",
              "--rate", "1000", "--out", str(tmp_path))
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a target missed at this toy size
    report = msgspec.json.decode((tmp_path / "lanes.json").read_bytes())
    assert [(p["lanes"], p["order"]) for p in report["points"]] == [(2, "same"), (2, "rotated")]
    assert all(p["seconds"] > 0 and len(p["samples"]) == 1 for p in report["points"])
    # 3 generators: one order makes the first forward to the third in both lanes; rotated, half of it
    assert [p["max_uplink_versions"] for p in report["points"]] == [1.0, 0.5]
    # the lane term at the link efficiency this run measured over one link, first
    assert 0 < report["eta"] <= 1 and report["one_link_seconds"] > 0
    assert all(p["model_at_eta"] == pytest.approx(p["model_seconds"] / report["eta"]) for p in report["points"])
    assert (tmp_path / "lanes.png").stat().st_size > 10_000
