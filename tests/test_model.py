# -*- coding: utf-8 -*-
"""FalconNet models: cache decoding, generate(), padding, Auto classes, hybrid attention, configs."""

import warnings

import pytest
import torch
from conftest import DEVICE
from fla.utils import assert_close
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from fla_falcon.layers import FalconNet
from fla_falcon.models import FalconNetConfig, FalconNetForCausalLM, FalconNetModel

RULES = ['falcon1', 'falcon2', 'falcon3', 'falcon1a', 'falcon2a', 'falcon3a']
VOCAB = 64
# fp32 everywhere; GPU kernels may use TF32 dots
TOL = 1e-4 if DEVICE == 'cpu' else 2e-3

try:
    import flash_attn  # noqa: F401
    HAS_FLASH_ATTN = True
except ImportError:
    HAS_FLASH_ATTN = False


def tiny_config(rule='falcon1', **kwargs):
    opts = dict(attn_mode=rule, hidden_size=32, head_dim=8, num_heads=2, expand_v=1.0, num_hidden_layers=1,
                vocab_size=VOCAB, hidden_ratio=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                # fla's fused cross entropy needs a GPU
                fuse_cross_entropy=DEVICE == 'cuda')
    opts.update(kwargs)
    return FalconNetConfig(**opts)


def make_model(config, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return AutoModelForCausalLM.from_config(config).to(DEVICE).eval()


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return fn(*args, **kwargs)


@pytest.mark.parametrize('rule', RULES)
def test_loss_backward(rule):
    model = make_model(tiny_config(rule, gate_param='step' if rule.endswith('a') else 'gain')).train()
    ids = torch.randint(3, VOCAB, (2, 8), device=DEVICE)
    out = quiet(model, ids, labels=ids)
    assert torch.isfinite(out.loss) and out.logits.shape == (2, 8, VOCAB)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize('rule', RULES)
def test_cache_decoding_equals_full(rule):
    """Logits at every position: prefill 4 tokens, then one token at a time with the cache, == full
    forward. The windowed rules use a window (8) longer than the prompt."""
    config = tiny_config(rule, window=8 if rule in ('falcon3', 'falcon3a') else None, lam_coupled=rule == 'falcon2',
                         num_hidden_layers=2 if rule == 'falcon1' else 1)
    model = make_model(config)
    ids = torch.randint(3, VOCAB, (2, 9), device=DEVICE)
    with torch.no_grad():
        ref = quiet(model, ids, use_cache=False).logits
        out = quiet(model, ids[:, :4], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(4, ids.shape[1]):
            # transformers 5 names the cache `cache` (generate() passes it so): both names must work
            name = 'cache' if t % 2 else 'past_key_values'
            out = quiet(model, ids[:, t:t + 1], use_cache=True, **{name: cache})
            logits.append(out.logits)
            cache = out.past_key_values
    assert_close('logits', ref, torch.cat(logits, 1), TOL)


def test_generate_matches_greedy_loop():
    """generate() with the cache scores every new token as the full forward (no cache) does on the same
    prefix, and picks its argmax. On a GPU the two paths run different kernels (chunk for the full forward,
    fused_recurrent steps with the cache; fp32 dots in TF32), so a near tie in this random model may pick
    another token there: the logits are compared with a tolerance, the tokens bitwise on the CPU only.
    min_new_tokens=4 makes generate() mask <eos> (id 2) in the scores it picks from, so the greedy loop
    masks it too, and the tokens are checked against the processed scores, not the raw logits (on the
    H200 the raw argmax was <eos> once)."""
    model = make_model(tiny_config('falcon3a', window=6))
    eos = model.config.eos_token_id
    prompt = torch.randint(3, VOCAB, (2, 4), device=DEVICE)
    with torch.no_grad():
        out = quiet(model.generate, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                    do_sample=False, min_new_tokens=4, output_logits=True, output_scores=True,
                    return_dict_in_generate=True)
        gen = out.sequences
        assert gen.shape == (2, 8)
        # teacher-forced on generate's own tokens: the full forward's logits at the positions before them
        ref = quiet(model, gen[:, :-1], use_cache=False).logits[:, 3:]
        assert_close('generate logits', ref, torch.stack(out.logits, 1), TOL)
        scores = torch.stack(out.scores, 1)
        assert bool((scores[..., eos] == float('-inf')).all())   # the min-length processor's mask
        assert torch.equal(gen[:, 4:], scores.argmax(-1))
        if DEVICE == 'cpu':
            ids = prompt
            for _ in range(4):   # no cache: the full forward every step, <eos> masked as generate() does
                logits = quiet(model, ids, use_cache=False).logits[:, -1]
                nxt = logits.index_fill(-1, torch.tensor([eos], device=DEVICE), float('-inf')).argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
            assert torch.equal(gen, ids)


def test_left_padded_batch_equals_single():
    model = make_model(tiny_config('falcon2', gate_param='step'))
    seqs = [torch.randint(3, VOCAB, (n,), device=DEVICE) for n in (5, 2)]
    T = 5
    ids = torch.stack([torch.cat([torch.zeros(T - len(s), dtype=torch.long, device=DEVICE), s]) for s in seqs])
    mask = torch.stack([torch.cat([torch.zeros(T - len(s), device=DEVICE), torch.ones(len(s), device=DEVICE)])
                        for s in seqs]).long()
    with torch.no_grad():
        logits = quiet(model, ids, attention_mask=mask).logits
        gen = quiet(model.generate, ids, attention_mask=mask, max_new_tokens=2, do_sample=False, min_new_tokens=2)
        for i, s in enumerate(seqs):
            ref = quiet(model, s[None]).logits[0]
            assert_close(f'seq{i}', ref, logits[i, T - len(s):], TOL)
            single = quiet(model.generate, s[None], attention_mask=torch.ones_like(s[None]), max_new_tokens=2,
                           do_sample=False, min_new_tokens=2)
            assert torch.equal(single[0, len(s):], gen[i, T:])


def test_beam_search_generate():
    """Beam search reorders fla's Cache, FalconState included."""
    model = make_model(tiny_config('falcon3a', window=3))
    prompt = torch.randint(3, VOCAB, (1, 4), device=DEVICE)
    with torch.no_grad():
        out = quiet(model.generate, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                    num_beams=2, do_sample=False, min_new_tokens=3)
    assert out.shape == (1, 7) and torch.equal(out[:, :4], prompt)


def test_auto_classes_round_trip(tmp_path):
    fields = tiny_config('falcon3a', qk_norm='l2', lam_coupled=True, gate_param='step').to_dict()
    fields.pop('model_type')
    config = AutoConfig.for_model('falcon_net', **fields)
    assert isinstance(config, FalconNetConfig) and config.window == 4
    model = make_model(config)
    assert isinstance(model, FalconNetForCausalLM)
    assert isinstance(quiet(AutoModel.from_config, config), FalconNetModel)
    layer = model.model.layers[0].attn
    assert isinstance(layer, FalconNet) and layer.gate_param == 'step' and layer.qk_norm == 'l2'
    quiet(model.save_pretrained, tmp_path)
    config2 = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config2, FalconNetConfig)
    for name in ('attn_mode', 'window', 'qk_norm', 'shift', 'lam_coupled', 'gate_param', 'mode'):
        assert getattr(config2, name) == getattr(config, name), name
    model2 = quiet(AutoModelForCausalLM.from_pretrained, tmp_path).to(DEVICE).eval()
    assert isinstance(model2, FalconNetForCausalLM)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = torch.randint(3, VOCAB, (1, 7), device=DEVICE)
    with torch.no_grad():
        assert torch.equal(quiet(model, ids).logits, quiet(model2, ids).logits)


def test_gate_bias_init():
    model = make_model(tiny_config('falcon1', gate_param='step'))
    for block in model.model.layers:
        attn = block.attn
        assert torch.allclose(attn.eta_bias, torch.full_like(attn.eta_bias, 1.0986122886681098))
        lam = torch.nn.functional.softplus(attn.lam_bias)
        alpha = lam / (lam + attn.energy_ref)   # decay fraction at beta = 1, E = E_ref
        assert ((alpha > 9e-4) & (alpha < 0.11)).all()


def hybrid_config():
    return tiny_config('falcon1', num_hidden_layers=2, attn={'layers': [1], 'num_heads': 2})


def test_hybrid_construction(monkeypatch):
    """Softmax-attention layers come from fla's `attn` spec, exactly as in GatedDeltaNet."""
    import fla.layers.attn as fla_attn
    from fla.layers.attn import Attention
    if not HAS_FLASH_ATTN:   # fla's Attention refuses to construct without flash-attn
        monkeypatch.setattr(fla_attn, 'flash_attn_func', lambda *a, **k: None)
    model = make_model(hybrid_config())
    assert isinstance(model.model.layers[0].attn, FalconNet)
    assert isinstance(model.model.layers[1].attn, Attention)
    assert model.config.attn['layers'] == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="fla's Attention needs flash-attn")
def test_hybrid_forward_and_decoding():
    model = make_model(hybrid_config())
    ids = torch.randint(3, VOCAB, (2, 10), device=DEVICE)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = model(ids[:, :4], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(4, 10):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    assert_close('hybrid', ref, torch.cat(logits, 1), 2e-3)


def test_gated_deltanet_baseline_config():
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    config = tiny_config('falcon2', mode='fused_recurrent', use_gate=False, conv_size=3)
    gdn = config.to_gated_deltanet_config()
    assert isinstance(gdn, GatedDeltaNetConfig) and gdn.attn_mode == 'fused_recurrent'
    for name in ('hidden_size', 'head_dim', 'num_heads', 'expand_v', 'use_gate', 'conv_size', 'vocab_size',
                 'num_hidden_layers', 'hidden_ratio', 'fuse_cross_entropy'):
        assert getattr(gdn, name) == getattr(config, name), name
    falcon = make_model(config)
    baseline = quiet(GatedDeltaNetForCausalLM, gdn)
    # everything outside the mixers is identical
    outside = lambda m: {n: p.shape for n, p in m.named_parameters() if '.attn.' not in n}  # noqa: E731
    assert outside(falcon) == outside(baseline)


@pytest.mark.parametrize('kwargs,match', [
    (dict(attn_mode='chunk'), 'attn_mode'),
    (dict(attn_mode='falcon3', window=0), 'window'),
    (dict(attn_mode='falcon1', window=2), 'window'),
    (dict(num_v_heads=3), 'num_v_heads'),
    (dict(expand_v=0.01), 'expand_v'),
    (dict(allow_neg_eigval=True), 'allow_neg_eigval'),
    (dict(qk_norm='none'), 'qk_norm'),
    (dict(gate_param='eta'), 'gate_param'),
    (dict(mode='recurrent'), 'mode'),
    (dict(attn={'layers': [5], 'num_heads': 2}), 'layers'),
    (dict(fuse_cross_entropy=True, fuse_linear_cross_entropy=True), 'cross_entropy'),
])
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kwargs)
