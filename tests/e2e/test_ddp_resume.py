"""`torchrun --nproc_per_node 2 -m training train` on tiny kanji (CPU, gloo, 127.0.0.1): a run
killed mid-epoch (one rank dies hard; torchrun tears the other down) and resumed under torchrun
with --resume ends where an uninterrupted 2-rank run ends: the same validation history, selected
epoch, test metrics and weights.  Rank 0 alone writes the run folder."""
import json

import pytest
import torch
from support import run_module

from model.checkpoint import read_checkpoint

pytestmark = pytest.mark.multiprocess  # torchrun, two ranks

FONTS = "ipag,ipam,seto,kouzan-sousyo,ume-gothic,ukai"

# a torchrun worker that dies (os._exit, no clean-up) at its 5th step on rank 1: 3 steps an epoch here,
# so mid-epoch 2, after epoch 1's latest.pt
KILLER = """
import os, sys
from training import step as S
calls = [0]
orig = S.Step.__call__
def call(self, *a, **kw):
    calls[0] += 1
    if calls[0] == 5 and os.environ["RANK"] == "1":
        os._exit(9)
    return orig(self, *a, **kw)
S.Step.__call__ = call
from training.cli import main
sys.exit(main(sys.argv[1:]))
"""


def torchrun(*args, cwd):
    return run_module("torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args, cwd=cwd,
                      env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    t = tmp_path_factory.mktemp("ddp_resume")
    return t, ["--dataset", "kanji", "--data-root", t / "kanji", "--num-classes", "20", "--image-size", "32",
               "--kanji-fonts", FONTS, "--backbone", "small_cnn", "--weights", "none", "--embed-dim", "16",
               "--epochs", "3", "--batch-size", "16", "--m-per-class", "4", "--lr", "1e-3", "--cache-dir",
               t / "cache", "--no-progress", "--threads", "1"]


def history(run):
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (run / "log.jsonl").read_text().splitlines()]


def test_killed_mid_epoch_resumes_under_torchrun_to_the_uninterrupted_result(common):
    t, args = common
    full = torchrun("-m", "training", "train", *args, "--out", t / "full", cwd=t)
    assert full.returncode == 0, full.stderr[-3000:]
    assert full.stdout.count('"selected_epoch"') == 1  # one report, from rank 0
    assert sorted(p.name for p in (t / "full").iterdir()) == [
        "best.pt", "config.toml", "curve.png", "latest.pt", "log.jsonl", "metrics.json"]

    script = t / "killer.py"
    script.write_text(KILLER)
    killed = torchrun(script, "train", *args, "--out", t / "cut", cwd=t)
    assert killed.returncode != 0
    assert not (t / "cut" / "metrics.json").exists()
    assert [h["epoch"] for h in history(t / "cut")] == [1]  # died in epoch 2, after epoch 1's checkpoint

    resumed = torchrun("-m", "training", "train", *args, "--out", t / "cut", "--resume", cwd=t)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr
    a, b = (json.loads((t / r / "metrics.json").read_text()) for r in ("full", "cut"))
    assert b["selected_epoch"] == a["selected_epoch"]
    assert b["val"] == a["val"] and b["test"] == a["test"]
    assert history(t / "cut") == history(t / "full")
    sa, sb = (read_checkpoint(t / r / "best.pt")["state_dict"] for r in ("full", "cut"))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
