"""DMT towers: tower modules on the embedding servers, host topology, hierarchical all-to-all."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dense_trainer.distributed import launch_local
from dense_trainer.metrics import roc_auc
from dense_trainer.train import Trainer
from dlrm_core.errors import ConfigError
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.publish import publish_checkpoint
from embedding_server.runtime.topology import Topology
from embedding_server.stores import open_store
from embedding_server.towers.layout import TowerLayout
from embedding_server.towers.module import TowerModule
from embedding_server.towers.partition import contiguous_towers
from embedding_server.towers.plan import TowerPlan
from embedding_server.towers.report import make_plan

from .conftest import REPO, tiny_config

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
NAMES = [f"C{i + 1}" for i in range(26)]


def files(d):
    return [d / "train.txt"], [d / "test.txt"]


def write_plan(path, k=2, compress=None, interleaved=False):
    groups = (
        [list(range(t, 26, k)) for t in range(k)] if interleaved else contiguous_towers(NAMES, k)
    )
    make_plan(NAMES, groups, "manual", compress).save(path)
    return str(path)


# -- units -----------------------------------------------------------------------------------------


def test_topology_even_labels_and_file(tmp_path):
    t = Topology.even(num_trainers=2, num_servers=4, num_hosts=2)
    assert t.hosts == (0, 1, 0, 0, 1, 1) and t.uniform and t.ranks_on(1) == [1, 4, 5]
    assert t.peers(0) == [0, 1] and t.local_index(4) == 1
    assert Topology.from_labels(["b", "a", "b"]).hosts == (0, 1, 0)
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({"hosts": [[0, 2], [1]]}))
    assert Topology.load(path, 3).hosts == (0, 1, 0) and not Topology.load(path, 3).uniform
    path.write_text(json.dumps({"hosts": [[0, 2]]}))
    with pytest.raises(ConfigError, match="rank 1 is on no host"):
        Topology.load(path, 3)
    with pytest.raises(ConfigError, match="does not exist"):
        Topology.load(tmp_path / "missing.json", 3)


def test_tower_module_identity_and_compression():
    z = torch.randn(5, 4, 8)
    assert TowerModule(4, 4, 8)(z) is z
    m = TowerModule(4, 2, 8)
    out = m(z)
    assert out.shape == (5, 2, 8)
    out.sum().backward()
    assert m.mix.grad is not None and m.pairs.weight.shape == (16, 6)
    # at start: group sums
    assert torch.allclose(out, torch.stack([z[:, :2].sum(1), z[:, 2:].sum(1)], 1) / 2**0.5)


def test_layout_places_each_tower_on_its_own_servers(tmp_path):
    spec = tiny_config().feature_spec()
    plan = TowerPlan.load(write_plan(tmp_path / "p.json", k=2, compress=3))
    layout = TowerLayout(plan, spec, num_servers=4, num_trainers=3)
    assert layout.servers_of == [[0, 1], [2, 3]] and layout.num_outputs == 6
    assert [layout.assigned(1, r) for r in range(3)] == [2, 2, 3]
    sharding = layout.sharding("rowwise_adagrad")
    for p in sharding.pieces:
        tower = 0 if p.table_index < 13 else 1
        assert p.server in layout.servers_of[tower]
    with pytest.raises(ConfigError, match="--tower-dim 16: the tower outputs compress"):
        TowerLayout(plan, spec, 2, 1, out_dim=16)
    with pytest.raises(ConfigError, match="2 towers need at least 2 embedding servers"):
        TowerLayout(plan, spec, num_servers=1, num_trainers=1)
    mean = tiny_config(embedding={"pooling": "mean"}).feature_spec()
    with pytest.raises(ConfigError, match="row-wise with mean pooling"):
        TowerLayout(plan, mean, 4, 1).sharding("rowwise_adagrad", "row_wise")


# -- real processes --------------------------------------------------------------------------------


@pytest.mark.slow
def test_identity_towers_hierarchical_match_one_process(synth_small, tmp_path):
    """c_t = F_t: the tower model is the flat model, whatever the partition (here odd and even
    features); with 2 emulated hosts, 2 servers per tower (the intra-tower exchange) and the
    hierarchical all-to-all, losses match one process."""
    over = {"train": {"log_step_losses": True, "max_steps": 40, "batch_size": 256}}
    flat = tiny_config(**over, data={"interleave": 2}, model={"first_order": False})
    single = Trainer(flat, tmp_path / "single").fit(*files(synth_small))  # as towers run it
    cfg = tiny_config(
        **over,
        dist={
            "embedding_servers": 4,
            "trainers": 2,
            "hosts": 2,
            "hierarchical": True,
            "towers": write_plan(tmp_path / "id.json", interleaved=True),
        },
    )
    towers = launch_local(cfg, *files(synth_small), tmp_path / "towers", resume=False)
    a, b = np.array(single["step_losses"]), np.array(towers["step_losses"])
    assert len(a) == len(b) == 40
    assert np.max(np.abs(a - b) / np.abs(a)) < 1e-5
    assert abs(single["test_auc"] - towers["test_auc"]) < 1e-4
    assert towers["cross_host_bytes_per_sample"] > 0


@pytest.mark.slow
def test_compressed_towers_checkpoint_resume_and_reshard(synth_small, tmp_path):
    plan = write_plan(tmp_path / "c2.json", compress=2)
    run = lambda servers, out, resume, **train: launch_local(  # noqa: E731
        tiny_config(
            train={"log_step_losses": True, "batch_size": 256, **train},
            dist={"embedding_servers": servers, "trainers": 1, "towers": plan},
        ),
        *files(synth_small),
        tmp_path / out,
        resume=resume,
    )
    full = run(2, "a", False)
    run(2, "b", False, max_steps=30)
    ckpt = latest_checkpoint(tmp_path / "b" / "checkpoints")
    assert (ckpt / "tower-0.pt").exists() and (ckpt / "tower-1.pt").exists()
    # the same 30 steps, resumed onto 4 servers below
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = run(2, "b", True)
    assert resumed["test_auc"] == full["test_auc"]
    assert resumed["step_losses"] == full["step_losses"][30:]
    # onto 4 servers (2 per tower): same maths up to float summation order
    resharded = run(4, "c", True)
    assert np.allclose(resharded["step_losses"], full["step_losses"][30:], rtol=1e-4)
    assert full["test_auc"] > 0.6
    # published, the tower model scores online as it scored offline
    meta = publish_checkpoint(
        latest_checkpoint(tmp_path / "a" / "checkpoints"),
        open_store(f"file://{tmp_path / 'store'}"),
    )
    assert meta.towers is not None and meta.towers["towers"][0]["compress"] == 2
    lines = (synth_small / "test.txt").read_text().splitlines()
    predictions = []
    with TestClient(create_app(Settings(store=f"file://{tmp_path / 'store'}"))) as client:
        for lo in range(0, len(lines), 2500):  # at most 4096 lines per request
            r = client.post("/v1/models/dlrm:predict_tsv", content="\n".join(lines[lo : lo + 2500]))
            assert r.status_code == 200, r.text
            predictions += r.json()["predictions"]
    labels = np.array([int(line.split("\t", 1)[0]) for line in lines])
    assert abs(roc_auc(np.array(predictions), labels) - full["test_auc"]) < 1e-4


@pytest.mark.slow
def test_plan_towers_cli_and_train_errors(synth_small, tmp_path):
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [
            *DLRM,
            "plan-towers",
            "-k",
            "2",
            "--train",
            str(synth_small / "train.txt"),
            "--config",
            "configs/tiny.toml",
            "--warmup-rows",
            "5000",
            "--compress",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "kept interaction share" in r.stdout
    plan = TowerPlan.load(out)
    assert plan.method == "interaction" and sorted(
        f for t in plan.towers for f in t.features
    ) == sorted(NAMES)
    assert all(t.outputs == 2 for t in plan.towers) and 0 < plan.kept_share <= 1
    bad = subprocess.run(
        [*DLRM, "plan-towers", "-k", "27", "--out", str(out), "--method", "random"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--towers 27" in bad.stderr
    no_servers = subprocess.run(
        [
            *DLRM,
            "train",
            "--train",
            str(synth_small / "train.txt"),
            "--test",
            str(synth_small / "test.txt"),
            "--out",
            str(tmp_path / "x"),
            "--towers",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_servers.returncode != 0 and "--towers needs --embedding-servers" in no_servers.stderr


def _exchange_worker(rank, port, result_dir):
    import torch.distributed as dist

    from embedding_server.runtime.exchange import Exchange, make_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    topology = Topology((0, 1, 1, 0))  # host 1's local order is reversed against host 0's peers
    intra, peers = make_groups(topology, hierarchical=True)
    flat, hier = Exchange(topology, rank), Exchange(topology, rank, True, intra, peers)
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 5, size=(20, 4, 4))  # per round: sizes[src, dst]
    sizes[3] = 0  # a round where nothing moves
    ok = True
    for r, s in enumerate(sizes):
        send = torch.arange(int(s[rank].sum()), dtype=torch.float32) + 1000 * rank + 100000 * r
        out_a = torch.empty(int(s[:, rank].sum()))
        out_b = torch.empty_like(out_a)
        flat.all_to_all(out_a, send, s[:, rank].tolist(), s[rank].tolist())
        hier.all_to_all(out_b, send, s[:, rank].tolist(), s[rank].tolist())
        ok &= torch.equal(out_a, out_b)
    (result_dir / f"{rank}.json").write_text(
        json.dumps(
            {
                "ok": bool(ok),
                "flat": flat.stats["cross_host_bytes"],
                "hier": hier.stats["cross_host_bytes"],
                "flat_msgs": flat.stats["cross_host_messages"],
                "hier_msgs": hier.stats["cross_host_messages"],
            }
        )
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_hierarchical_all_to_all_equals_flat(tmp_path):
    import torch.multiprocessing as mp

    from dense_trainer.distributed import free_port

    mp.start_processes(
        _exchange_worker, args=(free_port(), tmp_path), nprocs=4, start_method="spawn"
    )
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] for r in results)
    # same bytes cross
    assert sum(r["flat"] for r in results) == sum(r["hier"] for r in results) > 0
    # in fewer messages
    assert sum(r["hier_msgs"] for r in results) <= sum(r["flat_msgs"] for r in results)


def test_pair_reliance_sees_only_pairs_the_model_uses():
    from dense_trainer.model import DLRMDense
    from dense_trainer.tower_planning import pair_reliance
    from dlrm_core.batch import Batch, SparseFeatures

    torch.manual_seed(0)
    cfg = tiny_config(model={"first_order": False}).model  # as the planner's warm-up runs
    model = DLRMDense(13, [8] * 4, cfg, 8)
    first = model.over_arch.model[0]
    n, d = 5, 8
    rows, cols = torch.triu_indices(n, n, offset=1)
    pair = {
        (int(r) - 1, int(c) - 1): k
        for k, (r, c) in enumerate(zip(rows, cols, strict=True))
        if r > 0
    }
    with torch.no_grad():
        first.weight[:, d + pair[(0, 1)]] = 0  # the over arch ignores C1 x C2
    table = torch.randn(4, 100, 8)
    ids = torch.randint(0, 100, (4, 256))
    probe = Batch(
        dense=torch.randn(256, 13), sparse=SparseFeatures.one_hot(ids), labels=torch.zeros(256)
    )
    lookup = lambda sp: torch.cat([table[f][ids[f]] for f in range(4)], dim=1)  # noqa: E731
    s = pair_reliance(model, lookup, probe)
    assert s.shape == (4, 4) and np.allclose(s, s.T) and s[0, 1] == 0
    assert (s[~np.eye(4, dtype=bool) & (s != s[0, 1])] > 0).all()


def test_flat_hierarchical_route_across_emulated_hosts_matches_one_process(synth_small, tmp_path):
    """The flat model over the hierarchical all-to-all, a trainer and a server on each of 2
    emulated hosts (whose pairs cross hosts, where the point-to-point route would split its
    messages in chunks: the collective route keeps one exchange per step): losses match one
    process."""
    over = {"train": {"log_step_losses": True, "max_steps": 30, "batch_size": 256}}
    single = Trainer(tiny_config(**over, data={"interleave": 2}), tmp_path / "single").fit(
        *files(synth_small)
    )
    cfg = tiny_config(
        **over, dist={"embedding_servers": 2, "trainers": 2, "hosts": 2, "hierarchical": True}
    )
    flat = launch_local(cfg, *files(synth_small), tmp_path / "flat", resume=False)
    a, b = np.array(single["step_losses"]), np.array(flat["step_losses"])
    assert len(a) == len(b) == 30
    assert np.max(np.abs(a - b) / np.abs(a)) < 1e-5
    assert flat["cross_host_bytes_per_sample"] > 0
