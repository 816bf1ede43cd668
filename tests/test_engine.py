"""Plain generation (LLM.generate) against transformers, and the API's behaviour on bad input."""
from __future__ import annotations

import pytest
import torch

from forerun.sampling_params import SamplingParams
from tiny import hf_model, tiny_llm, tiny_tokenizer


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 9, 13, 22, 40, 7], [3], list(range(10, 60, 3)), [70, 71, 72, 70, 71]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_plain_greedy_matches_transformers_generate(arch):
    hf = hf_model(arch)
    llm = tiny_llm(hf)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(hf, p, 20)
        assert o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids)


def test_eos_and_stop_token_ids_and_max_tokens():
    hf = hf_model("llama")
    llm = tiny_llm(hf)
    ref = hf_greedy(hf, PROMPTS[0], 30)
    stop_at = ref[5]
    first = ref.index(stop_at)
    o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_at,),
                                                   ignore_eos=True))[0]
    assert o.token_ids == ref[: first + 1] and o.finish_reason == "stop"
    for n in (1, 2, 7):
        o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        assert o.token_ids == ref[:n] and o.finish_reason == "length"


def test_stop_string_truncates_text():
    hf = hf_model("llama")
    llm = tiny_llm(hf)
    ref = hf_greedy(hf, PROMPTS[2], 20)
    word = f"t{ref[6]}"
    text = llm.tokenizer.decode(ref)
    o = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, stop=(word,), ignore_eos=True))[0]
    assert o.finish_reason == "stop"
    assert o.text == text[: text.find(word)]


def test_sampling_is_seeded_and_follows_target_first_token():
    hf = hf_model("llama")
    llm = tiny_llm(hf)
    sp = SamplingParams(temperature=0.8, top_k=20, seed=123, max_tokens=8, ignore_eos=True)
    a = llm.generate([PROMPTS[0]], sp)[0].token_ids
    b = llm.generate([PROMPTS[0]], sp)[0].token_ids
    assert a == b
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, top_k=20, seed=124, max_tokens=8))[0].token_ids != a


def test_logprobs_match_log_softmax():
    hf = hf_model("qwen3")
    llm = tiny_llm(hf)
    o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    seq = PROMPTS[0] + o.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    for j, entry in enumerate(o.logprobs):
        row = lp[len(PROMPTS[0]) - 1 + j]
        assert entry["token_id"] == o.token_ids[j]
        assert abs(entry["logprob"] - row[o.token_ids[j]].item()) < 1e-4
        assert len(entry["top"]) == 3
        assert set(entry["top"]) == set(row.topk(3).indices.tolist())


def test_bad_inputs_raise_clear_errors_and_lose_nothing():
    hf = hf_model("llama", max_position_embeddings=64)
    llm = tiny_llm(hf)
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[5, 6], list(range(2, 66))], SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 600]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # nothing leaked: the engine still serves, and its pool is whole again
    free = llm.runner.kv.num_free_blocks
    o = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert o.token_ids == hf_greedy(hf, [5, 6], 5)
    assert llm.runner.kv.num_free_blocks == free


def test_long_generation_stops_at_context():
    hf = hf_model("llama", max_position_embeddings=32)
    llm = tiny_llm(hf)
    o = llm.generate([list(range(2, 22))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(o.token_ids) == 32 - 20 and o.finish_reason == "length"


def test_wrong_model_path():
    from forerun.engine.llm import LLM

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/no/such/model.gguf")


def test_stream_pieces_add_up_to_generate():
    hf = hf_model("llama")
    llm = tiny_llm(hf)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], sp)[0].text
    pieces = list(llm.stream(PROMPTS[0], sp))
    assert len(pieces) > 1 and "".join(pieces) == full


def test_cli_generate_on_a_checkpoint_directory(tmp_path, capsys):
    """End to end through `forerun generate`: HF directory -> loader -> engine -> text + stats."""
    from forerun.cli import main

    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    rc = main(["generate", "t5 t9 t13", "--model", str(tmp_path), "--draft", "early-exit:1", "--k", "3",
               "--raw", "--max-tokens", "8", "--ignore-eos", "--stats", "--compare-plain"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.strip().startswith("t")
    assert '"identical_to_plain": true' in err and '"acceptance_rate"' in err


def test_blocks_come_back_after_an_abandoned_stream_or_an_error():
    """A stream() its reader stops early, or a generate() that raises, leaves no KV blocks allocated."""
    from forerun.config import SpecConfig

    hf = hf_model("llama")
    llm = tiny_llm(hf, spec=SpecConfig(method="ngram", k=3))
    free = llm.runner.kv.num_free_blocks
    stream = llm.stream([5, 9, 13], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    assert llm.runner.kv.num_free_blocks == free
    with torch.no_grad():
        hf.lm_head.weight[7] = float("nan")
    bad = tiny_llm(hf)
    free = bad.runner.kv.num_free_blocks
    with pytest.raises(ValueError, match="request"):
        bad.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.7, max_tokens=3))
    assert bad.runner.kv.num_free_blocks == free


def test_from_model_runs_in_the_models_own_dtype():
    """LLM.from_model without a dtype takes the built model's (a float32 model on a GPU ran against a bf16 cache
    before: `forerun train-eagle --device cuda --corpus distill` failed in its first generation)."""
    from forerun.engine.llm import LLM
    from tiny import model_from_hf

    model = model_from_hf(hf_model("llama")).to(torch.bfloat16)
    llm = LLM.from_model(model, tiny_tokenizer(), device="cpu")
    assert llm.engine.dtype == torch.bfloat16 and llm.runner.dtype == torch.bfloat16
    out = llm.generate([[5, 9, 13]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert LLM.from_model(model_from_hf(hf_model("llama")), tiny_tokenizer(), device="cpu").engine.dtype == torch.float32


def test_request_metrics_time_the_first_token_apart_from_the_rest(monkeypatch):
    """RequestOutput.metrics (vLLM's): arrival <= first token <= last token = finish. Each target forward is made
    to take 50 ms, so the first token (the prompt's forward) comes ~1 forward after arrival and the other 4 tokens
    ~4 forwards later: a first-token time taken at the wrong commit (the last, or the arrival) fails the bounds."""
    import time

    llm = tiny_llm(hf_model("llama"))
    execute = type(llm.engine.runner).execute

    def slow(self, *a, **kw):
        time.sleep(0.05)
        return execute(self, *a, **kw)

    monkeypatch.setattr(type(llm.engine.runner), "execute", slow)
    t0 = time.monotonic()
    o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    t1 = time.monotonic()
    m = o.metrics
    assert len(o.token_ids) == 5 and m is not None
    assert t0 <= m.arrival_time <= m.first_token_time <= m.last_token_time == m.finished_time <= t1
    assert 0.05 <= m.time_to_first_token < m.decode_seconds
    assert m.decode_seconds >= 0.15  # at least 3 of the 4 later forwards (overlapped decoding may commit one late)
