"""``kvflow bench ttft`` run tiny: the modes agree, the JSON has its fixed keys, the plot draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvflow.bench.model import ModelShape, PagedModel
from kvflow.cli import main
from tests.support.pools import require_mooncake

TINY = [
    "--layers", "3", "--hidden", "64", "--mlp", "64", "--heads", "4", "--kv-heads", "2",
    "--head-dim", "32", "--block-size", "4", "--chunk-blocks", "2", "--tokens", "40",
    "--new-tokens", "3", "--repeats", "2", "--prefetch-variants", "1",
]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [[], ["--mla-dim", "48"], ["--store", "shared"], ["--store", "mooncake"]],
    ids=["kv-heads", "mla", "shared-pool", "mooncake"],
)
def test_ttft_modes_agree_and_json_has_fixed_keys(tmp_path: Path, extra: list[str]) -> None:
    if "mooncake" in extra:
        require_mooncake()
    path, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    assert main(["bench", "ttft", *TINY, *extra, "--json", str(path), "--plot", str(png)]) == 0
    result = json.loads(path.read_text())
    assert set(result["ttft_s"]) == {"hbm_hit", "layerwise", "non_layerwise", "recompute"}
    assert all(v > 0 for v in result["ttft_s"].values())
    for key in ("layerwise_over_hbm_hit", "non_layerwise_over_layerwise", "pipeline_efficiency"):
        assert result[key] > 0
    assert result["outputs_identical"] is True
    assert result["recompute_max_abs_diff"] < 1e-3
    config = result["config"]
    assert (config["layers"], config["prompt_tokens"], config["prefix_tokens"]) == (3, 35, 32)
    assert len(result["per_layer"]["compute_s"]) == len(result["per_layer"]["load_s"]) == 3
    assert len(result["timeline"]["layerwise"]["transfer"]) == 3
    assert png.stat().st_size > 10_000


def test_loaded_kv_is_what_the_model_computed() -> None:
    """The property the benchmark's output check rests on: same KV bytes, same output."""
    shape = ModelShape(layers=2, hidden=32, heads=2, kv_heads=2, head_dim=16, mlp=32, block_size=4)
    model = PagedModel(shape, num_blocks=8)
    pos = torch.arange(8)
    x = model.embed_tokens(pos)
    for i in range(2):
        x = model.layer(i, x, pos, first_block=0, n_ctx=8)
    tail = model.embed_tokens(pos[6:])
    for cache in model.caches:  # copy blocks 0-1 to 4-5: a "load" into other blocks
        cache[:, 4:6] = cache[:, 0:2]
    a, b = tail, tail
    for i in range(2):
        a = model.layer(i, a, pos[6:], first_block=0, n_ctx=8)
        b = model.layer(i, b, pos[6:], first_block=4, n_ctx=8)
    assert torch.equal(a, b)
    assert torch.allclose(a, x[6:], atol=1e-5)  # and it matches computing the whole prompt
    for cache in model.caches:
        cache[:, 4:6] = 0  # zeros instead of the prefix change the output
    c = tail
    for i in range(2):
        c = model.layer(i, c, pos[6:], first_block=4, n_ctx=8)
    assert not torch.allclose(a, c, atol=1e-3)


@pytest.mark.parametrize("mla", [0, 48])
def test_every_load_run_starts_from_zeroed_blocks(mla: int) -> None:
    """A load that failed must not pass for one that worked with the last run's bytes."""
    import argparse

    from kvflow.bench.ttft import _Bench, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*TINY, "--mla-dim", str(mla)])
    shape = ModelShape(
        layers=3, hidden=64, heads=4, kv_heads=2, head_dim=32, mlp=64, mla_dim=mla, block_size=4
    )
    bench = _Bench(args, shape)
    for cache in bench.model.caches:
        cache.fill_(1)
    bench.clear_load_blocks()
    for cache in bench.model.caches:
        loaded = cache[bench.load_blocks] if mla else cache[:, bench.load_blocks]
        assert not loaded.any()
        assert cache.any()  # the other blocks are untouched
