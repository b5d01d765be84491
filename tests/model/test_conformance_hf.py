"""Conformance with Hugging Face transformers (optional: needs torch and transformers).

The same SmolLM2 weights (dequantized from the GGUF file by refkv) are loaded into a
``transformers.LlamaForCausalLM`` built from a config that matches the GGUF metadata
(no download), and both compute the logits of a fixed chat prompt in float32. This
checks every convention at once against an independent implementation: the q/k row
un-permutation and "rotate half" RoPE, GQA head grouping, RMSNorm placement and epsilon,
SwiGLU, the tied LM head, and the (in, out) weight layout.

Tolerance: 1e-5 of the largest |logit| (~4e-4), the same float32 budget as the cached
vs. full comparison in ``test_real_model.py`` (two float32 implementations that sum in
different orders over 30 layers). Measured once here: max |diff| is printed with ``-s``.

The GGUF-to-transformers path also runs on a small synthetic model, so a mistake in
the un-permutation shows up even without the real model.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="conformance with transformers needs torch (pip install torch)")
transformers = pytest.importorskip("transformers",
                                   reason="conformance with transformers needs it (pip install transformers)")

from refkv.model import Model, random_weights  # noqa: E402

torch.set_num_threads(1)  # the machine is shared; one thread also makes the sums' order fixed


def _no_init():
    """Skip transformers' random initialisation (6 s for SmolLM2): every weight is loaded next."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def hf_model(model: Model):
    """A LlamaForCausalLM with refkv's weights, in float32, eager attention."""
    cfg = model.config
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.d_head, hidden_act="silu", max_position_embeddings=cfg.max_positions,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        attention_bias=False, mlp_bias=False)
    config._attn_implementation = "eager"
    with _no_init():
        hf = transformers.LlamaForCausalLM(config).to(torch.float32).eval()

    def t(a):
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C"))  # a writable copy

    w = model.weights
    state = {"model.embed_tokens.weight": t(w.embed), "model.norm.weight": t(w.final_norm)}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": t(lw.attn_norm), p + "post_attention_layernorm.weight": t(lw.mlp_norm),
            p + "self_attn.q_proj.weight": t(lw.wq.T), p + "self_attn.k_proj.weight": t(lw.wk.T),
            p + "self_attn.v_proj.weight": t(lw.wv.T), p + "self_attn.o_proj.weight": t(lw.wo.T),
            p + "mlp.gate_proj.weight": t(lw.w_gate.T), p + "mlp.up_proj.weight": t(lw.w_up.T),
            p + "mlp.down_proj.weight": t(lw.w_down.T)})
    state["lm_head.weight"] = t(w.embed if w.lm_head is None else w.lm_head.T)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        out = hf(torch.tensor(np.asarray(tokens)[None, :], dtype=torch.long), use_cache=False)
    return out.logits[0].numpy()


def _report(what, ours, theirs):
    diff, scale = np.abs(ours - theirs).max(), np.abs(theirs).max()
    print(f"\n{what} vs transformers {transformers.__version__}: max |diff| = {diff:.3g}, max |logit| = {scale:.3g}")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * scale)


def test_logits_match_transformers_on_the_real_model(smollm2, smollm2_tokenizer):
    tokens = smollm2_tokenizer.encode_chat("What is the capital of France? Answer in one word.")
    ours = smollm2.forward_full(tokens)
    theirs = hf_logits(hf_model(smollm2), tokens)
    diff = np.abs(ours - theirs).max()
    scale = np.abs(theirs).max()
    print(f"\nSmolLM2 vs transformers {transformers.__version__}: {len(tokens)} tokens, "
          f"max |diff| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff < 1e-5 * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_gguf_path_matches_transformers_on_a_small_model(tmp_path):
    """Write a random model as GGUF (rows permuted as llama.cpp does), read it, compare with transformers."""
    from test_gguf import SMALL, write_gguf

    from refkv.model import load

    weights = random_weights(SMALL, seed=11, dtype=np.float32)
    write_gguf(tmp_path / "small.gguf", weights=weights)
    ours = load(tmp_path / "small.gguf")
    tokens = np.arange(3, 250, 9)
    theirs = hf_logits(hf_model(Model(SMALL, weights)), tokens)
    _report("small GGUF model", ours.forward_full(tokens), theirs)


def test_checkpoint_saved_by_transformers_loads_in_refkv(tmp_path):
    from test_gguf import SMALL

    from refkv.model import load

    hf = hf_model(Model(SMALL, random_weights(SMALL, seed=12, dtype=np.float32)))
    hf.save_pretrained(tmp_path / "ckpt")
    ours = load(tmp_path / "ckpt")
    tokens = np.arange(5, 260, 11)
    theirs = hf_logits(hf, tokens)
    _report("checkpoint saved by transformers", ours.forward_full(tokens), theirs)
