"""Shipped shape files (regenerated from configs, checked against published counts) and the CLI."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shardkit.partition import (
    ParamSpec,
    _shape_gen,
    available_shapes,
    load_shapes,
    param_costs,
    partition,
)
from shardkit.partition._cli import main

# Published parameter counts (model cards / papers), independent of the generator.
PUBLISHED = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-xl": 1_557_611_200,
    "bert-base": 109_482_240,
    "resnet50": 25_557_032,
    "llama2-7b": 6_738_415_616,
    "vit-l16": 304_326_632,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}


def test_shipped_files_are_what_the_generator_writes() -> None:
    assert set(available_shapes()) == set(_shape_gen._MODELS)
    shipped = Path(_shape_gen.__file__).parent / "shapes"
    for name in available_shapes():
        assert (shipped / f"{name}.json").read_text() == _shape_gen._render(name), name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_match_published_counts(name: str) -> None:
    shapes = load_shapes(name)
    assert shapes.numel == PUBLISHED[name]
    assert len(shapes.names) == len(shapes.specs) == len(set(shapes.names))


def test_gpt2_small_matches_a_real_module_layout() -> None:
    # Rebuild GPT-2 small's first block with torch modules on the meta device and compare
    # shapes in registration order (HF Conv1D stores weights as [in, out]).
    shapes = load_shapes("gpt2-small")
    d = 768
    emb = [torch.nn.Embedding(50257, d, device="meta"), torch.nn.Embedding(1024, d, device="meta")]
    got = [ParamSpec.from_tensor(p) for m in emb for p in m.parameters()]
    assert list(shapes.specs[:2]) == got
    ln = torch.nn.LayerNorm(d, device="meta")
    assert list(shapes.specs[2:4]) == [ParamSpec.from_tensor(p) for p in ln.parameters()]
    assert shapes.names[4] == "transformer.h.0.attn.c_attn.weight"
    assert shapes.specs[4].shape == (768, 2304)


def test_resnet50_matches_torch_module_order() -> None:
    # torchvision is not a dependency; conv/bn counts of resnet50 are well known: 53 convs
    # (incl. 4 downsample), 53 batch norms (2 params each), 1 fc (2 params) = 161 params.
    shapes = load_shapes("resnet50")
    assert len(shapes.specs) == 53 + 53 * 2 + 2
    assert shapes.names[-2:] == ("fc.weight", "fc.bias")


def test_load_by_path_freeze_and_errors(tmp_path: Path) -> None:
    doc = {
        "name": "tiny",
        "params": [
            {"name": "emb.weight", "shape": [10, 4], "dtype": "bfloat16"},
            {"name": "head.weight", "shape": [4, 4], "requires_grad": False},
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(doc))
    shapes = load_shapes(path)
    assert shapes.specs == (
        ParamSpec((10, 4), torch.bfloat16, True),
        ParamSpec((4, 4), torch.float32, False),
    )
    assert load_shapes(str(path)).specs == shapes.specs
    frozen = load_shapes("bert-base").freeze(r"^embeddings\.")
    assert [s.requires_grad for s in frozen.specs[:6]] == [False] * 5 + [True]
    with pytest.raises(FileNotFoundError, match="neither a shipped shape file"):
        load_shapes("gpt5")
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": [{"shape": [2, -1]}]}')
    with pytest.raises(ValueError, match=r"params\[0\].*negative"):
        load_shapes(bad)
    bad.write_text('{"params": [{"shape": [2], "dtype": "float33"}]}')
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        load_shapes(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="'params' list"):
        load_shapes(bad)
    with pytest.raises(ValueError, match="invalid regular expression"):
        shapes.freeze("(")


def test_shipped_shapes_partition() -> None:
    # Every shipped shape file plans with every algorithm (the balance targets themselves are
    # tested in test_balanced.py).
    for name in available_shapes():
        specs = load_shapes(name).specs
        for algo in ("greedy", "sorted_greedy", "balanced"):
            p = partition(specs, 8, algorithm=algo)
            assert p.num_params == len(specs) and max(p.loads) >= p.lower_bound


def test_cli_plan_compares_algorithms(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--shapes",
                "gpt2-small",
                "--world",
                "4",
                "--algo",
                "greedy,balanced",
                "--algo",
                "sorted_greedy",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "gpt2-small: 148 parameters, 124,439,808 elements" in out
    assert out.count("imbalance (max/mean)") == 3
    for name in ("greedy", "balanced", "sorted_greedy"):
        assert re.search(rf"^\s+4  {name}\s+\d", out, re.MULTILINE), name
    assert "lower bound" in out


def _summary(out: str) -> dict[tuple[int, str], dict[str, str]]:
    """The CLI's comparison table as {(world, algorithm): {column: cell}}."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("world  algorithm"))
    columns = re.split(r"\s{2,}", lines[head].strip())
    rows: dict[tuple[int, str], dict[str, str]] = {}
    for line in lines[head + 2 :]:
        if not re.match(r"^\s*\d+  ", line):
            break
        cells = dict(zip(columns, re.split(r"\s{2,}", line.strip()), strict=True))
        rows[(int(cells["world"]), cells["algorithm"])] = cells
    return rows


def test_cli_prints_the_lower_bound_beside_each_result(capsys: pytest.CaptureFixture[str]) -> None:
    worlds = ["2", "16", "128"]
    assert (
        main(["plan", "--shapes", "vit-l16", "--world", *worlds, "--algo", "all", "--brief"]) == 0
    )
    rows = _summary(capsys.readouterr().out)
    assert len(rows) == 3 * 3
    specs = load_shapes("vit-l16").specs
    costs = param_costs(specs)
    for w in map(int, worlds):
        mean = math.fsum(costs) / w
        for algo in ("greedy", "sorted_greedy", "balanced"):
            p = partition(specs, w, algorithm=algo)
            cells = rows[(w, algo)]
            # The bound is max(largest param, mean load), computed here from the costs.
            assert cells["bound/mean"] == f"{max(max(costs), mean) / mean:.4f}"
            assert cells["max/bound"] == f"{max(p.loads) / max(max(costs), mean):.4f}"
            assert float(cells["max/bound"]) >= 1.0
    # At 128 ranks the largest parameter (an MLP weight) sets the bound, not the mean.
    assert float(rows[(128, "balanced")]["bound/mean"]) > 1.0


def test_describe_shows_the_lower_bound() -> None:
    costs = [3.0, 3.0, 2.0, 2.0, 2.0]
    p = partition([ParamSpec((1,), torch.float32)] * 5, 2, algorithm="sorted_greedy", costs=costs)
    assert p.lower_bound == 6.0 and max(p.loads) == 7.0
    text = p.describe()
    assert "lower bound max(largest param, mean): 6 (1.0000 x mean)" in text
    assert "max load / lower bound: 1.1667" in text


def test_cli_options_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(
            [
                "plan",
                "--shapes",
                "bert-base",
                "--world",
                "2",
                "8",
                "--algo",
                "all",
                "--brief",
                "--bytes-per-element",
                "12",
                "--freeze",
                "embeddings",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(5 frozen)" in out and "12 B/element" in out
    assert "Partition(" not in out  # --brief: comparison only
    assert main(["plan", "--shapes", "nope", "--world", "2"]) == 2
    assert "neither a shipped shape file" in capsys.readouterr().err
    assert main(["plan", "--shapes", "resnet50", "--world", "2", "--algo", "lpt"]) == 2
    assert "unknown algorithm 'lpt'" in capsys.readouterr().err
    assert main(["plan", "--shapes", "resnet50", "--world", "0"]) == 2
    assert main(["list"]) == 0
    assert "llama2-7b" in capsys.readouterr().out


def test_python_dash_m_entry_point() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit.partition",
            "plan",
            "--shapes",
            "resnet50",
            "--world",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Partition(algorithm='sorted_greedy', world_size=2, params=161" in proc.stdout


def test_balanced_beats_lpt_on_llama() -> None:
    # Many-for-many exchanges (see [Note: Balanced]) that LPT and single swaps cannot find.
    specs = load_shapes("llama2-7b").specs
    for w in (4, 8, 16):
        lpt = partition(specs, w, algorithm="sorted_greedy")
        bal = partition(specs, w, algorithm="balanced")
        assert bal.imbalance < lpt.imbalance
        assert bal.imbalance <= 1.002, (w, bal.imbalance)
