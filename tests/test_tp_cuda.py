"""TP 2 on two GPUs, whatever the suite's device (a module of its own: a process holds one TP
group, and test_tp's engines hold theirs until that module ends)."""

import pytest
import torch

from minisgl import LLM

from .conftest import assert_same_or_near_tie_as
from .test_tp import GREEDY, PROMPTS, SETTINGS

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_tp2_on_two_gpus_replays_cuda_graphs_with_tp1s_tokens(checkpoint) -> None:
    """NCCL all-reduces captured in the decode graphs (and the LM head's all-gather): the graphs
    give TP 1's greedy tokens."""
    path = str(checkpoint("qwen3"))
    cuda = {**SETTINGS, "device": "cuda"}
    want = LLM(path, **cuda).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(path, tp_size=2, **cuda) as tp2:
        assert tp2.engine.graph_runner is not None
        got = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert_same_or_near_tie_as(g["token_ids"], w)
