"""The CPU trainer's cheaper kernels compute what `speculators train` computes: the per-document
attention against SDPA over the trainer's own dense mask, the KL loss and argmax against the
trainer's, and the whole EAGLE3 head's loss and gradients with and without them."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from speculators.models.eagle3.attention import create_combined_mask_mod, extend_dense_mask_for_draft_tokens
from torch.nn.attention.flex_attention import create_mask

from controller.engines import vllm_engine as ve
from eagle3_training.cpu_kernels import argmax, kl_div_loss
from eagle3_training.document_attention import DocumentMask, document_attention

# Documents as the trainer packs them: runs of ids 0, 1, ... then padding (-1) to the row's length.
packs = st.lists(st.integers(1, 9), min_size=1, max_size=4).flatmap(
    lambda lengths: st.tuples(st.just(lengths), st.integers(0, 5)))


def _ids(lengths: list[int], padding: int) -> torch.Tensor:
    return torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * padding)


def _trainer_mask(ids: torch.Tensor, blocks: int) -> torch.Tensor:
    s = len(ids)
    mask = create_mask(create_combined_mask_mod(ids, s), None, None, s, s, device="cpu")
    for _ in range(blocks - 1):
        mask = extend_dense_mask_for_draft_tokens(mask, s)
    return mask


def _dense(mask: DocumentMask) -> torch.Tensor:
    """What the runs mean as the trainer's boolean mask [1, 1, S, blocks x S]: a query sees its own
    document causally in the first block, and only its own position in each later block."""
    s = mask.length
    q = torch.arange(s).unsqueeze(1)
    k = torch.arange(mask.blocks * s).unsqueeze(0)
    doc = torch.full((s,), -1, dtype=torch.long)
    for i, (a, b, real) in enumerate(mask.runs):
        if real:
            doc[a:b] = i
    same = (doc[q] != -1) & (doc[q] == doc[k % s])
    return ((q >= k) & same | (k % s == q)).unsqueeze(0).unsqueeze(0)


@given(packs, st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_the_document_mask_is_the_trainers_dense_mask(pack, blocks):
    ids = _ids(*pack)
    mask = DocumentMask.of(ids)
    for _ in range(blocks - 1):
        mask = mask.extended()
    assert torch.equal(_dense(mask), _trainer_mask(ids, blocks))


@given(packs, st.integers(1, 3), st.sampled_from([1, 3]), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_document_attention_is_sdpa_over_the_dense_mask_with_its_gradients(pack, blocks, groups, seed):
    ids = _ids(*pack)
    s, g = len(ids), torch.Generator().manual_seed(seed)
    mask = DocumentMask.of(ids)
    for _ in range(blocks - 1):
        mask = mask.extended()
    q = torch.randn(1, 2 * groups, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, blocks * s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, blocks * s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_trainer_mask(ids, blocks),
                                         enable_gqa=groups > 1).transpose(1, 2)
    out = document_attention(q, k, v, mask, None)
    assert torch.allclose(out, ref, atol=1e-10)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-10)


def test_a_mismatched_attention_is_named():
    mask = DocumentMask.of(_ids([3, 2], 1))
    with pytest.raises(ValueError, match="12 keys does not match a mask of 6 positions in 1 blocks"):
        document_attention(torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 12, 4), torch.zeros(1, 1, 12, 4), mask, None)


def test_the_kl_loss_and_its_gradient_are_the_trainers():
    from speculators.losses.eager import kl_div_loss as trainers

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 40, 300, generator=g) * 4).requires_grad_()
    targets = torch.randn(1, 40, 300, generator=g) * 8
    targets[0, 0, 5:] = -1e4  # a target with all but a few probabilities underflowing to 0
    ours, theirs = kl_div_loss(logits, targets), trainers(logits, targets)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    (a,), (b,) = torch.autograd.grad(ours.sum(), logits), torch.autograd.grad(theirs.sum(), logits)
    assert torch.allclose(a, b, atol=1e-7)


@given(st.lists(st.lists(st.integers(-3, 3), min_size=4, max_size=4), min_size=1, max_size=6))
def test_argmax_is_torchs_ties_included(rows):
    x = torch.tensor(rows, dtype=torch.bfloat16)  # small integers: many ties
    assert torch.equal(argmax(x, dim=-1), torch.argmax(x, dim=-1))
    assert torch.equal(argmax(x, dim=0, keepdim=True), torch.argmax(x, dim=0, keepdim=True))
    assert torch.equal(argmax(x), torch.argmax(x))


def _head_step(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    from speculators.losses import resolve_loss_config

    model.zero_grad()
    _, loss, metrics = model(**batch, ttt_steps=3, ttt_step_loss_decay=1.0,
                             loss_config=resolve_loss_config("kl_div", "eager"))
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_head_trains_alike_with_and_without_them():
    """The real EAGLE3 head for SmolLM2 (random weights, fp32): one packed row of three documents and
    padding, three test-time-training steps; loss and every gradient as the trainer's own path."""
    from eagle3_training import cpu_kernels, document_attention
    from eagle3_training.speculators_cpu import build_head

    model = build_head(ve.MODEL_FP32, 512, 48)
    lengths, s = [13, 20, 9], 48
    g = torch.Generator().manual_seed(1)
    batch = {"hidden_states": torch.randn(1, s, 3 * 576, generator=g),
             "input_ids": torch.randint(0, 512, (1, s), generator=g),
             "document_ids": _ids(lengths, s - sum(lengths)).unsqueeze(0),
             "loss_mask": torch.tensor([[1] * sum(lengths) + [0] * (s - sum(lengths))], dtype=torch.bool),
             "position_ids": torch.tensor([list(range(13)) + list(range(20)) + list(range(9)) + [0] * 6]),
             "verifier_last_hidden_states": torch.randn(1, s, 576, generator=g)}
    plain_loss, plain_grads = _head_step(model, batch)
    document_attention.install()
    cpu_kernels.install()
    assert isinstance(model._build_attn_mask(batch["document_ids"][0], s, "cpu"), DocumentMask)
    loss, grads = _head_step(model, batch)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert grads.keys() == plain_grads.keys() and len(grads) > 5
    for name, grad in grads.items():
        assert torch.allclose(grad, plain_grads[name], rtol=1e-4, atol=1e-6), name


def test_the_pipeline_asks_for_the_trainers_own_kernels_only_when_told(tmp_path):
    from eagle3_training.pipeline import PipelineConfig, train_command
    from eagle3_training.speculators_cpu import PLAIN_KERNELS

    def command(cfg: PipelineConfig) -> list[str]:
        return train_command(cfg, tmp_path, 0.9, 1e-3, tmp_path / "save", 1, None)

    assert PLAIN_KERNELS not in command(PipelineConfig())
    assert command(PipelineConfig(plain_kernels=True))[-1] == PLAIN_KERNELS
