"""flashattn inside Hugging Face transformers, through ``flashattn.integrations.transformers``:
tiny random models built from configs (no downloads), fp32 on the CPU and bf16 on CUDA (where
the kernels take fp16/bf16 only, as upstream's), against transformers' own "eager" and "sdpa"
on the same weights and device. Llama (GQA), Mistral (sliding window), Qwen2, Gemma 2 (softcap,
sliding window) and gpt-oss (sinks, sliding window); the last two against eager only, as
transformers' sdpa has neither softcap nor sinks. Forward with left padding, greedy generation,
a training step's gradients, packed sequences; BERT (bidirectional) and BART
(cross-attention); continuous batching (generate_batch, on the CPU). The error bound is four
times the eager-vs-sdpa difference of the same run, and at least the device's floor (the bound
of the models without sdpa). The CUDA cases exist only where torch sees a CUDA device."""

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (tests/python/requirements.txt has it)")

import flashattn.integrations.transformers as fx  # noqa: E402

NAME = fx.register()
VOCAB = 96
SEQ = 12
WINDOW = 5  # shorter than SEQ, so that the window masks keys
# fp32: the least bound, and the bound where no sdpa run measures the noise. Eager Gemma 2
# under transformers 4.53 differs from flashattn by up to 1e-5, the other pairs by ~3e-6.
FLOOR = 3e-5
# bf16 keeps 8 significant bits (rounding 2**-9 ~ 2e-3 per operation). Through two layers the
# logits of two correct implementations differ by 1e-2 to 2e-2 relative (eager vs sdpa ~1.2e-2,
# gpt-oss eager vs flashattn ~2e-2, measured in bf16), a wrong mask or window by 0.2 to 0.8;
# 5e-2 sits between. Gradients go through twice the bf16 rounding: 2e-2 to 6e-2 between
# correct implementations, so their floor is three times the logits'.
BF16_FLOOR = 5e-2
BF16_GRAD_FLOOR = 3 * BF16_FLOOR
# Greedy decoding in bf16: two tokens whose logits differ by less than this fraction of the
# step's largest |logit| are a tie that rounding may break either way (measured flips between
# eager, sdpa and flashattn: up to 0.055).
BF16_TIE = 2 * BF16_FLOOR
NOISE_FACTOR = 4.0

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
FLOORS = {"cpu": FLOOR, "cuda": BF16_FLOOR}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The models are tiny: torch's thread team only costs time (much of it on a loaded
    machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _common():
    # initializer_range well above the default 0.02 makes the softmax peaked, so that a wrong
    # mask or window changes the logits far beyond fp32 noise.
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                initializer_range=0.3, attention_dropout=0.0)


def _rope_default(config_class):
    """Plain RoPE for a config whose default is YaRN scaled for a long context."""
    if "rope_parameters" in config_class().to_dict():  # transformers >= 5
        return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return {"rope_scaling": None}


def _config(arch, device="cpu"):
    c = transformers
    if arch == "llama":
        return c.LlamaConfig(**_common())
    if arch == "mistral":
        return c.MistralConfig(sliding_window=WINDOW, **_common())
    if arch == "qwen2":
        return c.Qwen2Config(**_common())
    if arch == "gemma2":
        return c.Gemma2Config(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                              final_logit_softcapping=None, query_pre_attn_scalar=16,
                              **_common())
    if arch == "gpt_oss":
        # bf16: the router's top-2 of 4 flips between implementations on near-equal scores,
        # which moves the gradients by up to 0.9 relative; routing to all 4 has no choice.
        return c.GptOssConfig(head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                              num_experts_per_tok=2 if device == "cpu" else 4,
                              **_rope_default(c.GptOssConfig), **_common())
    raise AssertionError(arch)


ARCHS = ["llama", "mistral", "qwen2", "gemma2"]
if hasattr(transformers, "GptOssConfig"):
    ARCHS.append("gpt_oss")
HAS_SDPA = {"llama", "mistral", "qwen2"}  # gemma2: softcap; gpt_oss: sinks


def _same_weights(auto_class, cfg, impls, device="cpu"):
    """{impl: model} for "eager" and impls: the same random weights under each implementation
    (each model gets its own config: the implementation is a field of the config), on device in
    its dtype. Skips where this transformers gives the model a class per implementation instead
    of AttentionInterface."""
    models = {}
    for impl in ["eager"] + impls:
        try:
            m = auto_class.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        except KeyError:
            pytest.skip("this transformers' %s does not dispatch through AttentionInterface"
                        % cfg.model_type)
        if not models:
            with torch.no_grad():
                for mod in m.modules():
                    if isinstance(getattr(mod, "sinks", None), torch.Tensor):
                        mod.sinks.normal_(0.0, 2.0)  # sinks that matter (the init is ~0)
        else:
            m.load_state_dict(models["eager"].state_dict())
        models[impl] = m.eval()
    for m in models.values():
        m.to(device, DTYPES[device])
    assert models[NAME].config._attn_implementation == NAME
    return models


def _models(arch, device="cpu"):
    """The causal LM of arch under eager, flashattn and (where it has it) sdpa."""
    return _same_weights(transformers.AutoModelForCausalLM, _config(arch, device),
                         [NAME] + (["sdpa"] if arch in HAS_SDPA else []), device)


def _rel(a, b):
    a, b = a.float(), b.float()  # bf16 norms in fp32
    return ((a - b).norm() / b.norm()).item()


def _bound(errs, device="cpu", floor=None):
    floor = FLOORS[device] if floor is None else floor
    return max(NOISE_FACTOR * errs["sdpa"], floor) if "sdpa" in errs else floor


def _left_padded_batch(lengths=(SEQ, 7), device="cpu"):
    ids = torch.randint(0, VOCAB, (len(lengths), SEQ))
    mask = torch.zeros(len(lengths), SEQ, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, SEQ - n:] = 1
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_left_padding(arch, device):
    models = _models(arch, device)
    ids, mask = _left_padded_batch(device=device)
    valid = mask.bool()
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask).logits[valid] for k, m in models.items()}
    assert logits[NAME].device.type == device and logits[NAME].dtype == DTYPES[device]
    errs = {k: _rel(v, logits["eager"]) for k, v in logits.items() if k != "eager"}
    assert errs[NAME] <= _bound(errs, device), errs
    # The padded row's valid tokens equal the same tokens run alone (no padding).
    short = ids[1:, SEQ - 7:]
    with torch.no_grad():
        alone = models[NAME](short).logits[0]
    assert _rel(logits[NAME][SEQ:], alone) <= _bound(errs, device)


def _agrees_up_to_a_near_tie(tokens, ref_tokens, ref_logits, tie):
    """Each row of tokens equals ref_tokens (greedy: the argmax of ref_logits, one (batch,
    vocab) tensor per step) up to the first step where they differ, and there the reference
    rated both tokens alike: their logits differ by at most tie x the step's largest |logit|.
    From that step on the rows continue from different tokens and are not compared."""
    for r in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            a, b = int(tokens[r, t]), int(ref_tokens[r, t])
            if a != b:
                logits = ref_logits[t][r].double()
                gap = float(logits[b] - logits[a])
                assert gap <= tie * float(logits.abs().max()), (r, t, a, b, gap, tokens,
                                                                 ref_tokens)
                break


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_agrees(arch, cache, device):
    """Eight greedy tokens for a batch whose short row keeps padding inside the window while
    decoding. The static cache hands the function more key slots than the mask covers.

    fp32 (CPU): the tokens equal eager's. bf16 (CUDA): rounding can flip a near-tie between
    two tokens, after which the rows go on from different tokens; so the tokens equal eager's
    up to the first step where they differ, and there eager's own logits must rate the two
    tokens within BF16_TIE of each other (a tie, not a wrong token). A wrong mask or window
    changes the logits by far more (see BF16_FLOOR) and picks a token eager rates clearly
    lower. sdpa is held to the same rule."""
    models = _models(arch, device)
    ids, mask = _left_padded_batch((SEQ, 3), device)
    new = 8
    out, ref_logits = {}, None
    for k, m in models.items():
        gen = m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, cache_implementation=cache,
                         output_logits=True, return_dict_in_generate=True)
        out[k] = gen.sequences[:, SEQ:]
        if k == "eager":
            ref_logits = gen.logits
    assert out[NAME].shape == (2, new) and out[NAME].device.type == device
    for k in out:
        if device == "cpu":
            assert torch.equal(out[k], out["eager"]), (k, out[k], out["eager"])
        else:
            _agrees_up_to_a_near_tie(out[k], out["eager"], ref_logits, BF16_TIE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_training_step_gradients(arch, device):
    models = _models(arch, device)
    ids, mask = _left_padded_batch(device=device)
    # The loss reads the logits of position t with the label of t + 1: no label after a pad
    # token, whose output no implementation defines alike.
    labels = ids.masked_fill((mask == 0) | (mask.roll(1, -1) == 0), -100)
    grads = {}
    for k, m in models.items():
        m.train()
        m.zero_grad()
        m(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[k] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    names = sorted(grads["eager"])
    assert names == sorted(grads[NAME])
    if arch == "gpt_oss":
        assert any(n.endswith("sinks") for n in names)  # the sinks' gradient is compared too
    flat = {k: torch.cat([g[n].flatten().float() for n in names]) for k, g in grads.items()}
    errs = {k: _rel(v, flat["eager"]) for k, v in flat.items() if k != "eager"}
    bound = _bound(errs, device, FLOOR if device == "cpu" else BF16_GRAD_FLOOR)
    assert errs[NAME] <= bound, errs
    worst = max(_rel(grads[NAME][n], grads["eager"][n]) for n in names
                if grads["eager"][n].norm() > 0)
    # Per tensor: small gradients, larger ratios (bf16's floor already covers its spread).
    assert worst <= (10 if device == "cpu" else 3) * bound, worst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_sequences(arch, device):
    """Three sequences in one row, position_ids restarting at 0 (no cache, as in training):
    each attends only to itself, whether the boundaries come from position_ids or from the
    cu_seq_lens_* kwargs. The reference is eager on each sequence alone (transformers' eager
    gpt-oss ignores packing)."""
    models = _models(arch, device)
    cu = [0, 5, 9, 12]
    ids = torch.randint(0, VOCAB, (1, cu[-1]), device=device)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])]).unsqueeze(0).to(device)
    with torch.no_grad():
        alone = torch.cat([models["eager"](ids[:, a:b]).logits[0] for a, b in zip(cu, cu[1:])])
        logits = {k: m(ids, position_ids=pos, use_cache=False).logits[0]
                  for k, m in models.items() if k != "eager"}
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        by_kwargs = models[NAME](ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu_t,
                                 cu_seq_lens_k=cu_t, max_length_q=5, max_length_k=5).logits[0]
    errs = {k: _rel(v, alone) for k, v in logits.items()}
    assert errs[NAME] <= _bound(errs, device), errs
    assert _rel(by_kwargs, alone) <= _bound(errs, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_continuous_batching_generation(arch, device, monkeypatch):
    """transformers' continuous batching (generate_batch, its paged cache) under the registered
    name: three prompts of different lengths, at most 16 tokens per step, so that prefills are
    split and some requests decode beside another's prefill. The requests go through
    flashattn's varlen call together, and each request's tokens equal the same model's
    ordinary greedy generate of its prompt alone: exactly in fp32 (CPU); in bf16 (CUDA), where
    a step's batch changes the rounding, up to a near-tie as in test_greedy_generation_agrees.
    CUDA graphs and asynchronous batching stay off (the plain path)."""
    if not hasattr(transformers, "ContinuousBatchingConfig"):
        pytest.skip("this transformers has no ContinuousBatchingConfig (continuous batching "
                    "before transformers 5 takes other arguments)")
    model = _models(arch, device)[NAME]
    seen = []
    varlen = fx.flash_attn_varlen_func

    def spy(q, k, v, cu_q, cu_k, *args, **kwargs):
        seen.append((cu_q.numel() - 1, q.device.type))
        return varlen(q, k, v, cu_q, cu_k, *args, **kwargs)

    monkeypatch.setattr(fx, "flash_attn_varlen_func", spy)
    prompts = [torch.randint(1, VOCAB, (n,)).tolist() for n in (5, 9, 13)]  # 0 pads
    new = 8
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=16,
                                                     use_cuda_graph=False,
                                                     use_async_batching=False)
    try:
        out = model.generate_batch(prompts, generation_config=gen,
                                   continuous_batching_config=batching)
    except MemoryError as e:
        if "available memory 0" not in str(e):
            raise
        pytest.skip("this transformers sizes its paged cache on the CPU from psutil's free "
                    "memory and psutil is not installed: %s" % e)
    assert model.config._attn_implementation == NAME
    assert max((n for n, _ in seen), default=0) > 1, seen  # several requests in one call
    assert all(dev == device for _, dev in seen), seen
    got = {tuple(o.prompt_ids): (o.generated_tokens, o.error) for o in out.values()}
    assert len(got) == len(prompts)
    for p in prompts:
        ids = torch.tensor([p], device=device)
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                               output_logits=True, return_dict_in_generate=True)
        tokens = alone.sequences[:, len(p):]
        assert got[tuple(p)][1] is None, got[tuple(p)]
        if device == "cpu":
            assert got[tuple(p)] == (tokens[0].tolist(), None), (p, got[tuple(p)], tokens)
        else:
            _agrees_up_to_a_near_tie(torch.tensor([got[tuple(p)][0]]), tokens.cpu(),
                                     alone.logits, BF16_TIE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 3])
def test_paged_decode_with_block_table(window, device):
    """A decode batch as transformers' flash path hands it with a block table: one new token
    per request, appended to the request's pages (k_cache / v_cache (pages, page_size,
    heads_k, d), pages in random order, -1 past the last) after the cu_seq_lens_k[i + 1] -
    cu_seq_lens_k[i] - 1 keys already there, then attending to them (the last `window` under
    a sliding window). Slots past them hold NaN, which must not be read. The reference runs in
    fp32 on the values the device holds (bf16 on CUDA, whose output rounding 2**-9 of values
    below 4 stays under 1e-2)."""
    dtype, tol = DTYPES[device], {"cpu": 1e-5, "cuda": 2e-2}[device]
    h, hk, d, page = 4, 2, 16, 4
    lens = [5, 8, 1]  # keys in the cache before the new one
    r = len(lens)
    pages = [n // page + 1 for n in lens]  # room for the new token too
    order = torch.randperm(sum(pages) + 2).tolist()  # two pages no request owns
    k_cache = torch.full((len(order), page, hk, d), float("nan"))
    v_cache = torch.full((len(order), page, hk, d), float("nan"))
    table = torch.full((r, max(pages) + 1), -1, dtype=torch.int32)
    cached = []
    for i, n in enumerate(lens):
        own, order = order[:pages[i]], order[pages[i]:]
        table[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
        kv = torch.randn(2, n, hk, d).to(dtype).float()
        for j in range(n):
            k_cache[own[j // page], j % page] = kv[0, j]
            v_cache[own[j // page], j % page] = kv[1, j]
        cached.append(kv)
    q, k, v = (torch.randn(1, n, r, d).to(dtype).float() for n in (h, hk, hk))
    cu_k = torch.tensor([0] + [sum(lens[:i + 1]) + i + 1 for i in range(r)], dtype=torch.int32)
    k_dev, v_dev = k_cache.to(device, dtype), v_cache.to(device, dtype)
    out, weights = fx.attention_forward(
        _Module(True), *(t.to(device, dtype) for t in (q, k, v)), None, scaling=0.25,
        sliding_window=window, cu_seq_lens_q=torch.arange(r + 1, dtype=torch.int32,
                                                          device=device),
        cu_seq_lens_k=cu_k.to(device), max_length_q=1, max_length_k=1,
        block_table=table.to(device), k_cache=k_dev, v_cache=v_dev)
    assert weights is None and out.shape == (1, r, h, d) and out.device.type == device
    out, k_cache, v_cache = out.float().cpu(), k_dev.float().cpu(), v_dev.float().cpu()
    for i, n in enumerate(lens):
        slot = table[i, n // page], n % page
        assert torch.equal(k_cache[slot], k[0, :, i]) and torch.equal(v_cache[slot], v[0, :, i])
        keys = torch.cat((cached[i][0], k[0, :, i:i + 1].transpose(0, 1)))  # (n + 1, hk, d)
        vals = torch.cat((cached[i][1], v[0, :, i:i + 1].transpose(0, 1)))
        allowed = torch.arange(n + 1)[None, :] > (n - window if window else -1)
        ref = _masked_reference(q[:, :, i:i + 1], keys.transpose(0, 1)[None],
                                vals.transpose(0, 1)[None], allowed, 0.25)
        torch.testing.assert_close(out[:, i:i + 1], ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_bidirectional_encoder_right_padding(device):
    """BERT: a bidirectional module (is_causal False), right padding."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96,
                                  initializer_range=0.3, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    models = _same_weights(transformers.AutoModel, cfg, [NAME, "sdpa"], device)
    ids = torch.randint(0, VOCAB, (2, SEQ), device=device)
    mask = torch.ones(2, SEQ, dtype=torch.long, device=device)
    mask[1, 7:] = 0
    with torch.no_grad():
        out = {k: m(ids, attention_mask=mask).last_hidden_state[mask.bool()]
               for k, m in models.items()}
    errs = {k: _rel(v, out["eager"]) for k, v in out.items() if k != "eager"}
    assert errs[NAME] <= _bound(errs, device), errs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dec_len", [SEQ, 6])
def test_encoder_decoder_cross_attention(dec_len, device):
    """BART: the decoder's cross-attention takes the encoder's padding mask; its queries are
    the decoder's tokens, as many as the encoder's or not."""
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1,
                                  decoder_layers=1, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=96,
                                  decoder_ffn_dim=96, init_std=0.3, dropout=0.0,
                                  attention_dropout=0.0, max_position_embeddings=64)
    models = _same_weights(transformers.AutoModelForSeq2SeqLM, cfg, [NAME, "sdpa"], device)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=device)
    mask = torch.ones(2, SEQ, dtype=torch.long, device=device)
    mask[1, 7:] = 0
    dec = torch.randint(3, VOCAB, (2, dec_len), device=device)
    out = {}
    with torch.no_grad():
        for k, m in models.items():
            try:
                out[k] = m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
            except ValueError as e:  # refused with a clear error, not computed wrong
                if k == NAME and "2-D padding mask" in str(e):
                    pytest.skip("this transformers' BART builds 4-D masks itself")
                raise
    errs = {k: _rel(v, out["eager"]) for k, v in out.items() if k != "eager"}
    assert errs[NAME] <= _bound(errs, device), errs


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_in_training_only(device):
    cfg = transformers.LlamaConfig(**dict(_common(), attention_dropout=0.5))
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    m.to(device, DTYPES[device])
    ids, mask = _left_padded_batch(device=device)
    m.eval()
    with torch.no_grad():
        a = m(ids, attention_mask=mask).logits
        b = m(ids, attention_mask=mask).logits
    assert torch.equal(a, b)  # eval: no dropout
    m.train()
    torch.manual_seed(1)
    c = m(ids, attention_mask=mask).logits
    torch.manual_seed(1)
    d = m(ids, attention_mask=mask).logits
    assert torch.equal(c, d)  # torch's seed reproduces the dropout mask
    assert _rel(c, a) > 1e-2
    c.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


class _Module(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal


def _masked_reference(q, k, v, allowed, scale):
    """q (b, h, sq, d), k/v (b, hk, sk, d), allowed (sq, sk) bool -> (b, sq, h, d)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_convention(causal):
    """transformers' sliding window W: causal, key j is seen by query i iff i - W < j <= i;
    bidirectional, iff |i - j| <= W (masking_utils' overlays)."""
    q, k, v = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    i = torch.arange(10)[:, None]
    j = torch.arange(10)[None, :]
    w = 3
    allowed = ((j <= i) & (j > i - w)) if causal else (i - j).abs() <= w
    # transformers' own overlay agrees, where this version has it (the bidirectional one came
    # after 4.53).
    from transformers import masking_utils

    overlay = getattr(masking_utils, "sliding_window_overlay" if causal
                      else "sliding_window_bidirectional_overlay", None)
    if overlay is not None:
        seen = [[bool(overlay(w)(0, 0, a, b)) and (b <= a or not causal) for b in range(10)]
                for a in range(10)]
        assert torch.equal(torch.tensor(seen), allowed)
    out, weights = fx.attention_forward(_Module(causal), q, k, v, None, scaling=0.25,
                                        sliding_window=w)
    assert weights is None
    ref = _masked_reference(q, k, v, allowed, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sq", [1, 3])
def test_padding_with_fewer_queries_than_keys(sq):
    """Decoding (one query) and a chunk of queries after a cached prefix, rows left-padded
    differently, and two unused cache slots past the mask (as a static cache has): the queries
    are the mask's last columns, causal from the bottom-right corner."""
    b, sk, seen = 2, 10, 8
    q, k, v = torch.randn(b, 4, sq, 16), torch.randn(b, 2, sk, 16), torch.randn(b, 2, sk, 16)
    k[:, :, seen:] = float("nan")  # unused slots must not be read
    v[:, :, seen:] = float("nan")
    mask = torch.ones(b, seen, dtype=torch.bool)
    mask[1, :3] = False
    out, _ = fx.attention_forward(_Module(True), q, k, v, mask, scaling=0.25)
    i = torch.arange(sq)[:, None] + seen - sq
    j = torch.arange(seen)[None, :]
    allowed = (j <= i) & mask[:, None, None, :]
    ref = _masked_reference(q, k[:, :, :seen], v[:, :, :seen], allowed, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_register_rejects_reserved_names():
    for bad in ("flashattn", "my_flash", "sdpa2", "org/kernel", "paged|x", ""):
        with pytest.raises(ValueError, match="name"):
            fx.register(bad)
    from transformers import AttentionInterface

    assert fx.register("fattn_test") == "fattn_test"
    assert AttentionInterface()["fattn_test"] is fx.attention_forward


def test_mask_builder_refuses_what_it_would_drop():
    """The registered mask builder passes the padding mask on, and refuses a model's extra
    mask rules (transformers 5 flags them with use_vmap) and chunked attention."""
    from transformers.masking_utils import AttentionMaskInterface

    build = AttentionMaskInterface()[NAME]
    with pytest.raises(NotImplementedError, match="mask rules"):
        build(batch_size=1, q_length=4, kv_length=4, attention_mask=None, use_vmap=True)
    chunked = transformers.LlamaConfig(**_common())
    chunked.attention_chunk_size = 8
    with pytest.raises(NotImplementedError, match="attention_chunk_size"):
        build(batch_size=1, q_length=4, kv_length=4, attention_mask=None, config=chunked)


def test_unsupported_inputs_are_refused():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention_mask"):
        fx.attention_forward(_Module(True), q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="position_bias"):
        fx.attention_forward(_Module(True), q, k, v, None, position_bias=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="sliding_window"):
        fx.attention_forward(_Module(True), q, k, v, None, sliding_window=0)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        fx.attention_forward(_Module(True), q, k, v, None, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        fx.attention_forward(_Module(True), q, k, v, None, cu_seq_lens_q=cu[:1],
                             cu_seq_lens_k=cu)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        fx.attention_forward(_Module(True), q, k, v, None, block_table=table)
    with pytest.raises(NotImplementedError, match="k_cache"):
        fx.attention_forward(_Module(True), q[:, :, :1], k[:, :, :1], v[:, :, :1], None,
                             cu_seq_lens_q=cu[:2] // 4, cu_seq_lens_k=cu, block_table=table)
