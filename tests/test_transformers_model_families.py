"""Which transformers models ``ringseq.integrations.transformers.apply`` switches, and how it
checks the ones whose structure reaches the ring in unusual ways.

- Hybrid models whose tokens also meet outside softmax attention (Mamba, short-convolution and
  linear-attention layers) and ALiBi models are refused by ``apply``, before any
  communication: the ring would run the other mixers on each rank's shard alone, or leave the
  position biases out, and give other outputs without a word.
- A model whose attention function gets no position ids (GPT-BigCode adds learned position
  embeddings before its layers) has them checked from the model's own call: exact with
  ``shard_batch``'s positions, refused on every rank without them.

Tiny configs with random weights (no downloads); the ring numerics follow docs/design.md's
rule against float64 (tests/test_transformers_integration.py's module doc).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402
from utils import assert_close_per_design, error_text, scaled_floor  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)


def _hybrid(family):
    """A tiny hybrid model: layer 0 mixes tokens outside attention, layer 1 is attention."""
    if family == "lfm2":  # a short convolution
        return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            **SMALL, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False))
    if family == "jamba":  # a Mamba layer
        return transformers.JambaForCausalLM(transformers.JambaConfig(
            **SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            num_experts=2, mamba_d_state=4, mamba_dt_rank=8, mamba_expand=1))
    if family == "qwen3_next":  # a gated delta net (linear attention)
        return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **SMALL, head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32))
    raise ValueError(family)


@pytest.mark.parametrize("family,needle", [
    ("lfm2", r"a 'conv' layer \(config\.layer_types\[0\]\)"),
    ("jamba", r"a '(mamba|linear_attention)' layer \(config\.\w+\[0\]\)"),
    ("qwen3_next", r"a 'linear_attention' layer \(config\.layer_types\[0\]\)"),
])
def test_hybrid_models_are_refused_by_apply(family, needle):
    """Before: apply switched the attention layers only and the ring ran each rank's shard
    through the other layers alone (W=2 logits off by 1e-3 to 4e-2, no error)."""
    from ringseq.integrations.transformers import apply
    cls = {"lfm2": "Lfm2Config", "jamba": "JambaConfig", "qwen3_next": "Qwen3NextConfig"}
    if not hasattr(transformers, cls[family]):
        pytest.skip(f"this transformers has no {family}")
    torch.manual_seed(0)
    model = _hybrid(family)
    with pytest.raises(ValueError, match=rf"^apply: \w+ has {needle}.*each rank's own tokens"):
        apply(model)
    assert model.config._attn_implementation != "ringseq"  # left as it was


def _llama(**over):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "attention_dropout": 0.0, **over}))


def test_a_token_mixer_the_config_does_not_name_is_refused():
    """A 1-d convolution over the sequence added to a decoder layer (what Mamba and
    short-convolution blocks hold) is found by the module scan, named by its path."""
    from ringseq.integrations.transformers import apply
    model = _llama()
    model.model.layers[1].mlp.token_conv = torch.nn.Conv1d(64, 64, 3, groups=64)
    with pytest.raises(ValueError, match=r"^apply: LlamaForCausalLM mixes tokens outside softmax "
                                         r"attention in model\.layers\.1\.mlp\.token_conv "
                                         r"\(Conv1d\)"):
        apply(model)


def _whole_sequence_case(case):
    """A tiny model that reads the whole sequence outside attention, and the refusal's words."""
    T = transformers
    bert = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=128, max_position_embeddings=256)
    if case == "bert_classifier":  # pools the [CLS] token
        return (T.BertForSequenceClassification(T.BertConfig(**bert, num_labels=3)),
                r"BertForSequenceClassification's head pools the sequence .* switch the base "
                r"model \(BertModel\)")
    if case == "qwen3_classifier":  # pools the last non-pad token
        return (T.Qwen3ForSequenceClassification(T.Qwen3Config(**SMALL, pad_token_id=0)),
                r"Qwen3ForSequenceClassification's head pools the sequence")
    if case == "bert_pretraining":  # the next-sentence head reads the pooler
        return (T.BertForPreTraining(T.BertConfig(**bert)),
                r"BertForPreTraining's head pools the sequence")
    if case == "bert_pooler":  # a base model's pooler over the first token
        return (T.BertModel(T.BertConfig(**bert)),
                r"BertModel pools the sequence in its module 'pooler' \(the first token\): each "
                r"rank would pool its own shard's. Leave it out \(`pooler = None`, or "
                r"add_pooling_layer=False")
    if case == "esm_token_dropout":
        return (T.EsmForMaskedLM(T.EsmConfig(**bert, position_embedding_type="rotary",
                                             token_dropout=True, mask_token_id=32,
                                             pad_token_id=1)),
                r"EsmForMaskedLM rescales each row's embeddings by the fraction of <mask> "
                r"tokens in it \(config.token_dropout=True\)")
    return (T.MobileBertForMaskedLM(T.MobileBertConfig(
        **bert, embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32,
        num_feedforward_networks=1, trigram_input=True)),
        r"MobileBertForMaskedLM joins each token's embedding with its neighbours' "
        r"\(config.trigram_input=True\)")


@pytest.mark.parametrize("case", ["bert_classifier", "qwen3_classifier", "bert_pretraining",
                                  "bert_pooler", "esm_token_dropout", "mobilebert_trigram"])
def test_what_reads_the_whole_sequence_outside_attention_is_refused_by_apply(case):
    """Before: accepted, and at W=2 zigzag a classifier's logits were 6e-2 (BERT) and 2e-1
    (Qwen3) off on rank 1, a base BERT's pooler_output 0.43, ESM-2's with <mask> tokens 7e-2
    and MobileBERT's 9e-2 at the shard borders. The base model without its pooler, and the
    masked-LM heads without these options, stay accepted."""
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    model, needle = _whole_sequence_case(case)
    with pytest.raises(ValueError, match=r"^apply: " + needle):
        apply(model)
    bert = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, vocab_size=128)
    apply(transformers.BertModel(bert, add_pooling_layer=False))
    without = transformers.BertModel(bert)
    without.pooler = None
    apply(without)
    # a refusal that leaving the pooler out does not fix comes first (RoBERTa's positions)
    with pytest.raises(ValueError, match=r"^apply: RobertaModel numbers its positions from "
                                         r"padding_idx \+ 1"):
        apply(transformers.RobertaModel(transformers.RobertaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            vocab_size=128)))


def _paligemma():
    T = transformers
    torch.manual_seed(0)
    return T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
        text_config=dict(model_type="gemma", **SMALL, head_dim=16, max_position_embeddings=256,
                         pad_token_id=0),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16,
                           patch_size=8),
        image_token_id=127, projection_dim=64, hidden_size=64, vocab_size=128,
        pad_token_id=0)).eval()


def test_a_language_model_whose_layers_are_bidirectional_but_its_mask_causal_stays_causal():
    """PaliGemma's Gemma layers have is_causal False (use_bidirectional_attention), its mask is
    causal (create_causal_mask): the mask decides, as in transformers. Before: ring attention
    ran bidirectional, each token seeing the ones after it (logits 1e-1 off at W=2; on one
    process too)."""
    from ringseq.integrations.transformers import apply
    model = _paligemma()
    ids = torch.randint(1, 120, (2, 48), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, token_type_ids=torch.ones_like(ids), use_cache=False,
                  position_ids=torch.arange(48).expand(2, 48))  # (PaliGemma's own: from 1)
    with torch.no_grad():
        want = model(**kwargs).logits
        apply(model)
        got = model(**kwargs).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_a_bidirectional_model_whose_mask_is_widened_stays_bidirectional():
    """Gemma 3 with use_bidirectional_attention (EmbeddingGemma) builds its mask as
    create_causal_mask(or_mask_function=lambda *a: True): not a causal mask, so its
    non-causal layers stay non-causal (my first version of the PaliGemma rule ran them causal,
    3.7 off)."""
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, max_position_embeddings=256, use_bidirectional_attention=True,
        sliding_window=512, layer_types=["full_attention", "full_attention"])).eval()
    ids = torch.randint(1, 120, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).last_hidden_state
        apply(model)
        got = model(input_ids=ids, use_cache=False).last_hidden_state
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("family", ["stablelm", "falcon"])
def test_a_layer_that_drops_the_documents_boundaries_is_named(family):
    """StableLM's and Falcon's decoder layers call the attention without **kwargs, so a
    packed batch's cu_seq_lens_q never reaches it (FalconForCausalLM does not even hand them
    to its base model). Before: refused with "pass cu_seq_lens_q and cu_seq_lens_k", which
    the caller had passed."""
    import ringseq
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    T = transformers
    model = apply(T.StableLmForCausalLM(T.StableLmConfig(**SMALL)) if family == "stablelm" else
                  T.FalconForCausalLM(T.FalconConfig(
                      hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                      new_decoder_architecture=True, num_kv_heads=2)))
    name = "StableLmAttention" if family == "stablelm" else "FalconAttention"
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (13, 7, 20, 8)]
    full = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=True)([{"input_ids": d} for d in docs])
    batch = ringseq.shard_batch(dict(full), layout="zigzag")
    batch.pop("shift_labels")
    batch.pop("labels", None)
    with pytest.raises(ValueError, match=rf"^{name}: the model was called with packed "
                                         r"documents' boundaries \(cu_seq_lens_q\), but its "
                                         r"layer calls the attention without them"):
        model(**batch, use_cache=False)


def test_a_multimodal_models_vision_tower_keeps_its_attention():
    """Qwen2-VL's vision attention modules carry ``scaling`` too; their config is the vision
    sub-config, so apply leaves them (before: switched, and every image refused)."""
    from ringseq.integrations.transformers import _attention_modules, apply
    T = transformers
    torch.manual_seed(0)
    model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
        text_config=dict(**SMALL, head_dim=16, max_position_embeddings=256,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, in_chans=3,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=100, vision_start_token_id=101, vision_end_token_id=102,
        video_token_id=103))
    vision = model.config.vision_config._attn_implementation
    apply(model)
    assert model.config.vision_config._attn_implementation == vision != "ringseq"
    assert model.config.get_text_config()._attn_implementation == "ringseq"
    switched = {type(m).__name__ for m in _attention_modules(model)}
    assert switched and not any("Vision" in n for n in switched), switched


def _assert_exact_and_wrong_positions_refused(build, ranks, module):
    """``ranks`` at W=2 returns (the unsharded logits, the error text of a call with wrong
    positions): the logits of ``build()``'s model within flash-attn's rule of float64, and
    the call refused on every rank by ``module``'s position check."""
    want64 = build(torch.float64)(input_ids=_ids(), use_cache=False).logits.detach()
    plain = build()(input_ids=_ids(), use_cache=False).logits.detach()
    for rank, (logits, wrong) in enumerate(run_ranks(ranks, 2, timeout=120)):
        assert_close_per_design(logits, want64, plain, f"rank {rank} logits", 2.0,
                                scaled_floor(torch.float32, want64))
        assert wrong.startswith(f"ValueError: {module}: ringseq attention cannot compute this "
                                f"exactly: position_ids that are not the global positions of "
                                f"this rank's tokens under layout 'zigzag'"), wrong


def _qwen2_vl(dtype=torch.float32):
    T = transformers
    torch.manual_seed(0)
    model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
        text_config=dict(**SMALL, head_dim=16, max_position_embeddings=256,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
        image_token_id=100, vision_start_token_id=101, vision_end_token_id=102,
        video_token_id=103))
    return model.to(dtype).eval()


def _qwen2_vl_ranks():
    import ringseq
    from ringseq.integrations.transformers import apply
    model = apply(_qwen2_vl(), layout="zigzag")
    batch = ringseq.shard_batch({"input_ids": _ids()}, layout="zigzag")
    pos = batch.pop("position_ids")  # (b, s_local): the global positions of the rank's tokens
    local = torch.arange(pos.shape[-1]).expand_as(pos)  # numbered from 0 on every rank
    with torch.no_grad():
        # 4-row ids: the text row, then M-RoPE's temporal, height and width rows
        four = torch.stack([pos, pos, pos, pos])  # (4, b, s_local)
        logits = ringseq.unshard(model(**batch, position_ids=four, use_cache=False).logits,
                                 "zigzag")
        rope_from_0 = torch.stack([pos, local, local, local])
        wrong = error_text(lambda: model(**batch, position_ids=rope_from_0, use_cache=False))
    return logits, wrong


def test_every_row_of_mrope_position_ids_is_checked():
    """Qwen2-VL takes 4-row position ids and hands its attention the text row only; the other
    three rotate q and k. W=2, text only: the 4-row ids of shard_batch's positions match one
    process; rope rows numbered from 0 on every rank are refused on every rank (before: only
    the text row was checked, logits 1.2e-3 off without a word)."""
    _assert_exact_and_wrong_positions_refused(_qwen2_vl, _qwen2_vl_ranks, "Qwen2VLAttention")


def test_alibi_is_refused_by_apply():
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, alibi=True,
        new_decoder_architecture=False, multi_query=True, attention_dropout=0.0))
    # before: an AttributeError from inside Falcon's model ('NoneType' ... 'dtype')
    with pytest.raises(ValueError, match=r"^apply: FalconForCausalLM adds ALiBi position "
                                         r"biases .* \(config alibi=True\)"):
        apply(model)


@pytest.mark.parametrize("build, needle", [
    # before: accepted; each rank attended to its own shard (logits 2e-2 off at W=2)
    (lambda: transformers.XGLMForCausalLM(transformers.XGLMConfig(
        vocab_size=64, d_model=32, num_layers=1, attention_heads=4, ffn_dim=64)),
     r"^apply: transformers cannot switch XGLMForCausalLM to ringseq attention \(its "
     r"attention does not dispatch through AttentionInterface"),
    # before: accepted; T5's relative position bias dropped (hidden states 0.11 off float64)
    (lambda: transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
     r"^apply: T5EncoderModel adds a learned relative position bias to its attention scores "
     r"\(T5Attention.relative_attention_bias\)"),
    # before: accepted; positions numbered from padding_idx + 1 (logits 0.61 off)
    (lambda: transformers.RobertaForCausalLM(transformers.RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, is_decoder=True)),
     r"^apply: RobertaForCausalLM numbers its positions from padding_idx \+ 1 "
     r"\(RobertaEmbeddings\)"),
])
def test_models_whose_attention_ringseq_would_not_compute_exactly_are_refused(build, needle):
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=needle):
        apply(build())


def test_an_additive_position_bias_reaching_the_attention_function_is_refused():
    from ringseq.integrations.transformers import apply, ringseq_attention_forward
    model = apply(_llama())
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match=r"an additive position bias \(position_bias"):
        ringseq_attention_forward(attn, q, q[:, :2], q[:, :2], None, dropout=0.0,
                                  scaling=attn.scaling, position_bias=torch.zeros(1, 4, 8, 8))


def test_plain_models_are_not_taken_for_hybrids():
    """Class names are matched by whole words (GptOssMLP holds no "ssm"), and per-token layer
    kinds (Nemotron-H style "mlp" / "moe") are no token mixers."""
    from ringseq.integrations.transformers import _is_other_mixer, apply
    assert not _is_other_mixer(type("GptOssMLP", (torch.nn.Module,), {})())
    assert _is_other_mixer(type("JambaMambaMixer", (torch.nn.Module,), {})())
    assert _is_other_mixer(type("Lfm2ShortConv", (torch.nn.Module,), {})())
    model = _llama(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention"] * 2,
                   sliding_window=8)
    model.config.layers_block_type = ["full_attention", "mlp", "moe", "full_attention"]
    assert apply(model).config._attn_implementation == "ringseq"


def test_a_tower_outside_the_language_model_may_hold_convolutions():
    """An audio or vision tower's layers (their attention has another config than the language
    model's) run whole inputs on every rank: their convolutions are no reason to refuse (before
    this rule: Phi-4-multimodal, whose audio encoder holds Conv1d layers, was refused)."""
    from ringseq.integrations.transformers import apply

    class AudioAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scaling, self.config = 0.125, transformers.PretrainedConfig()

    class AudioLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.conv = AudioAttention(), torch.nn.Conv1d(8, 8, 3)

    model = _llama()
    model.audio_tower = torch.nn.ModuleList([AudioLayer()])
    assert apply(model).config._attn_implementation == "ringseq"
    model.model.layers[0].mlp.conv = torch.nn.Conv1d(8, 8, 3)  # in the language model: refused
    with pytest.raises(ValueError, match=r"in model\.layers\.0\.mlp\.conv \(Conv1d\)"):
        apply(model)


# ------------------------------------------------------------------ GPT-BigCode
SEQ = 48


def _bigcode(dtype=torch.float32):
    torch.manual_seed(3)
    model = transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0))
    return model.to(dtype).eval()


def _ids():
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(4))


def _bigcode_ranks():
    import ringseq
    from ringseq.integrations.transformers import apply
    model = apply(_bigcode(), layout="zigzag")
    batch = ringseq.shard_batch({"input_ids": _ids()}, layout="zigzag")
    with torch.no_grad():
        logits = ringseq.unshard(model(**batch, use_cache=False).logits, "zigzag")
        forgot = error_text(lambda: model(input_ids=batch["input_ids"], use_cache=False))
    return logits, forgot


def test_bigcode_positions_are_checked_from_the_model_call():
    """GPT-BigCode hands its attention no position ids. W=2: with shard_batch's positions the
    logits match one process; without them (before: every rank embedded positions from 0,
    logits off by 0.7, no error) every rank raises."""
    _assert_exact_and_wrong_positions_refused(_bigcode, _bigcode_ranks, "GPTBigCodeAttention")


def test_bigcode_packed_documents_without_boundaries_are_refused_on_one_process():
    """Restarting positions without cu_seq_lens_q would attend across documents (before: no
    error, the second document's logits off by 0.27). The refusal names the module and says
    what is missing (before: "not the global positions ... under layout 'contiguous'", a
    layout this model was not switched with)."""
    from ringseq.integrations.transformers import apply
    model = apply(_bigcode(), layout="documents")
    restart = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)])[None]
    with pytest.raises(ValueError, match=r"^GPTBigCodeAttention: ringseq attention cannot compute "
                                         r"this exactly: position_ids that restart within a row, "
                                         r"as packed documents' do, without the documents' "
                                         r"boundaries: pass cu_seq_lens_q"):
        model(input_ids=_ids()[:1], position_ids=restart, use_cache=False)
    # other wrong positions, those that go back without restarting at 0 included, name the
    # layout the model was switched with (before, on one process: 'contiguous', whatever the
    # model's layout)
    zigzag = apply(_bigcode(), layout="zigzag")
    for wrong in (torch.arange(1, SEQ + 1), torch.arange(SEQ).flip(0),
                  torch.cat([torch.arange(SEQ // 2), torch.arange(2, SEQ - SEQ // 2 + 2)])):
        with pytest.raises(ValueError, match=r"^GPTBigCodeAttention: .*position_ids that are "
                                             r"not the global positions of this rank's tokens "
                                             r"under layout 'zigzag'"):
            zigzag(input_ids=_ids()[:1], position_ids=wrong[None], use_cache=False)
    model(input_ids=_ids()[:1], use_cache=False)  # the model's own positions are the global ones


def _moe_with_window(family, dtype=torch.float32, window=24):
    """A tiny MoE model whose layers build a sliding-window mask but call the attention
    without ``sliding_window=`` (PhiMoE, Qwen2-MoE)."""
    torch.manual_seed(0)
    if family == "phimoe":
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **SMALL, sliding_window=window, num_local_experts=2, num_experts_per_tok=2,
            input_jitter_noise=0.0, router_jitter_noise=0.0,
            experts_implementation="eager"))  # (the grouped one takes no float64)
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **SMALL, use_sliding_window=window is not None, sliding_window=window,
            max_window_layers=2,
            num_experts=2, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, experts_implementation="eager"))
    return model.to(dtype).eval()


def _moe_window_ranks(family):
    import ringseq
    from ringseq.integrations.transformers import apply
    model = apply(_moe_with_window(family), layout="zigzag")
    batch = ringseq.shard_batch({"input_ids": _ids()}, layout="zigzag")
    with torch.no_grad():
        return ringseq.unshard(model(**batch, use_cache=False).logits, "zigzag")


@pytest.mark.parametrize("family", ["phimoe", "qwen2_moe"])
def test_a_window_only_the_mask_carries_is_kept(family):
    """The window of a model that passes it in its mask only (before: dropped, full causal
    attention, logits off by 0.2-0.3 at W=1 and 2 without an error). W=2 logits match one
    process with eager attention, which is windowed (float64 reference, the design rule);
    the same model without a window is far from it."""
    want64 = _moe_with_window(family, torch.float64)
    want64.set_attn_implementation("eager")
    want64 = want64(input_ids=_ids(), use_cache=False).logits.detach()
    plain = _moe_with_window(family)
    plain.set_attn_implementation("eager")
    plain = plain(input_ids=_ids(), use_cache=False).logits.detach()
    unwindowed = _moe_with_window(family, torch.float64, window=None)
    unwindowed.set_attn_implementation("eager")
    unwindowed = unwindowed(input_ids=_ids(), use_cache=False).logits.detach()
    assert (unwindowed - want64).abs().max() > 1e-2  # (SEQ tokens are more than the window)
    for rank, logits in enumerate(run_ranks(_moe_window_ranks, 2, family, timeout=120)):
        assert_close_per_design(logits, want64, plain, f"rank {rank} logits", 2.0,
                                scaled_floor(torch.float32, want64))


def test_a_mask_window_the_layer_contradicts_is_refused():
    """A layer that passes another window than its mask was built with: refused, naming
    both (ringseq cannot tell which one the model means)."""
    from ringseq.integrations.transformers import _window_of_mask
    marked = torch.ones(1, 1, 4, 4).bool()
    marked.ringseq_window = 24
    assert _window_of_mask("L", marked, None) == (24, False)
    assert _window_of_mask("L", marked, 24) == (24, False)
    assert _window_of_mask("L", None, 16) == (16, False)
    marked.ringseq_window_inclusive = True  # (transformers' bidirectional overlay's)
    # its layers pass w (T5Gemma) or w + 1 (EmbeddingGemma 2, Ultrabert: a review's repro,
    # refused by a first version)
    assert _window_of_mask("L", marked, 24) == _window_of_mask("L", marked, 25) == (24, True)
    with pytest.raises(ValueError, match=r"^L: the layer passes sliding_window=26, but its "
                                         r"attention mask was built with a sliding window of "
                                         r"24 tokens on each side"):
        _window_of_mask("L", marked, 26)
    marked.ringseq_window_inclusive = False
    with pytest.raises(ValueError, match=r"^L: the layer passes sliding_window=16, but its "
                                         r"attention mask was built with a sliding window of "
                                         r"24 tokens"):
        _window_of_mask("L", marked, 16)


def _t5gemma(dtype=torch.float32, layer_types=("sliding_attention", "full_attention")):
    """T5Gemma with an encoder sliding window of 8 (transformers' bidirectional overlay:
    |q - k| <= 8, two keys more per row than (7, 7))."""
    torch.manual_seed(0)
    side = dict(SMALL, head_dim=16, max_position_embeddings=256, sliding_window=8,
                layer_types=list(layer_types), query_pre_attn_scalar=16,
                attn_logit_softcapping=None, final_logit_softcapping=None)
    cfg = transformers.T5GemmaConfig(encoder=transformers.T5GemmaModuleConfig(**side),
                                     decoder=transformers.T5GemmaModuleConfig(**side),
                                     dropout_rate=0.0, attention_dropout=0.0, vocab_size=128)
    return transformers.T5GemmaForConditionalGeneration(cfg).to(dtype).eval()


def _deepseek(dtype=torch.float32):
    """DeepSeek-V3's latent attention: value heads of 12 beside query / key heads of 24."""
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **dict(SMALL, num_key_value_heads=4), q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
        experts_implementation="eager")).to(dtype).eval()


def _assert_inexact(results: dict, key: str, module: str, what: str) -> None:
    """``results[key]`` is the refusal, on this rank, of a call ring attention would not
    compute exactly, by ``module`` (the attention class), starting with ``what``."""
    assert results[key].startswith(f"ValueError: {module}: ringseq attention cannot compute "
                                   f"this exactly: {what}"), results


def _encoder_decoder_and_latent_ranks():
    import ringseq
    from ringseq.integrations.transformers import apply
    t5 = apply(_t5gemma(), layout="zigzag")
    enc, dec = _ids().clamp(min=1), _ids().flip(1).clamp(min=1)  # (T5Gemma pads 0)
    batch = ringseq.shard_batch({"input_ids": enc}, layout="zigzag")
    dec_local = ringseq.shard(dec, "zigzag", dim=1)
    positions = ringseq.positions(SEQ, "zigzag")[None].expand(2, -1)
    padded = torch.ones(2, SEQ, dtype=torch.long)
    padded[0, 5:8] = padded[1, 20:22] = 0  # (on both ranks' shards)
    padded = ringseq.shard(padded, "zigzag", dim=1)
    out = {}
    with torch.no_grad():
        out["t5gemma"] = ringseq.unshard(t5(**batch, decoder_input_ids=dec_local,
                                            decoder_position_ids=positions,
                                            use_cache=False).logits, "zigzag")
        out["decoder positions left out"] = error_text(lambda: t5(
            **batch, decoder_input_ids=dec_local, use_cache=False))
        out["decoder padding"] = error_text(lambda: t5(
            **batch, decoder_input_ids=dec_local, decoder_position_ids=positions,
            decoder_attention_mask=padded, use_cache=False))
        deepseek = apply(_deepseek(), layout="zigzag")
        out["deepseek"] = ringseq.unshard(deepseek(**ringseq.shard_batch(
            {"input_ids": enc}, layout="zigzag"), use_cache=False).logits, "zigzag")
        out["labels"] = error_text(lambda: deepseek(**batch, labels=batch["input_ids"],
                                                    use_cache=False))
    return out


def test_encoder_decoder_windows_latent_attention_and_labels_over_a_ring():
    """At W=2 (zigzag):
    - T5Gemma's encoder window is transformers' inclusive bidirectional one, |q - k| <= w
      (before: run as (w - 1, w - 1), logits 0.09 off without a word);
    - its decoder's inputs are checked apart from the encoder's: decoder position ids left
      out and a decoder padding mask are refused on every rank (before: the check ran once
      per model call, at the encoder's first layer, and both passed: logits 0.01 and 0.25
      off);
    - DeepSeek-V3's latent attention (value heads smaller than query / key heads) runs
      exactly (before: refused at every forward with the kernels' head-dim message);
    - labels given to the model are refused (before: each rank's loss shifted its shard's
      labels within the shard).
    Logits against the float64 models with eager attention (the design rule)."""
    enc, dec = _ids().clamp(min=1), _ids().flip(1).clamp(min=1)  # (T5Gemma pads 0)
    wants = {}
    for name, build, kwargs in (("t5gemma", _t5gemma, dict(decoder_input_ids=dec)),
                                ("deepseek", _deepseek, {})):
        pair = []
        for dtype in (torch.float64, torch.float32):
            model = build(dtype)
            model.set_attn_implementation("eager")
            with torch.no_grad():
                pair.append(model(input_ids=enc, **kwargs, use_cache=False).logits)
        wants[name] = pair
    for rank, r in enumerate(run_ranks(_encoder_decoder_and_latent_ranks, 2, timeout=240)):
        for name, (want64, plain) in wants.items():
            assert_close_per_design(r[name], want64, plain, f"rank {rank} {name} logits", 2.0,
                                    scaled_floor(torch.float32, want64))
        _assert_inexact(r, "decoder positions left out", "T5GemmaSelfAttention",
                        "position_ids that are not the global positions")
        _assert_inexact(r, "decoder padding", "T5GemmaSelfAttention",
                        "an attention_mask with padding")
        _assert_inexact(r, "labels", "DeepseekV3Attention",
                        "labels passed to the model over 2 ranks")


def test_attention_modules_without_a_scale_attribute_are_named():
    """(before: ModernBERT, whose attention dispatches through the interface but takes its
    scale per call, was told it did not dispatch)"""
    from ringseq.integrations.transformers import apply
    model = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2,
        sep_token_id=1))
    with pytest.raises(ValueError, match=r"^apply: ModernBertForMaskedLM has no attention "
                                         r"modules .*; its ModernBertAttention modules hold no "
                                         r"`scaling` attribute$"):
        apply(model)


def _gemma3_two_layer_types():
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])).eval()


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0)).eval()


def _per_type_mask_and_labels_ranks():
    import torch.distributed as dist

    import ringseq
    from ringseq.integrations.transformers import apply
    rank, ids = dist.get_rank(), _ids()[:1, :16]
    gemma = apply(_gemma3_two_layer_types(), layout="contiguous")
    batch = ringseq.shard_batch({"input_ids": ids}, layout="contiguous")
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()[:, :, 8 * rank:8 * rank + 8]
    mask[..., :3] = False  # (this rank's rows of a 4D mask: the first 3 keys hidden)
    out = {"mask for the second layer type": error_text(lambda: gemma(
        **batch, attention_mask={"sliding_attention": None, "full_attention": mask},
        use_cache=False))}
    gpt2 = apply(_gpt2(), layout="contiguous")
    out["gpt2 labels"] = error_text(lambda: gpt2(**batch, labels=batch["input_ids"],
                                                 use_cache=False))
    # an encoder-decoder makes its decoder inputs from the labels, shifted right within the
    # rank's shard (before: wrong logits past the shard border, no error)
    t5 = apply(_t5gemma(), layout="contiguous")
    out["t5gemma labels alone"] = error_text(lambda: t5(
        input_ids=batch["input_ids"].clamp(min=1), position_ids=batch["position_ids"],
        labels=batch["input_ids"].clamp(min=1), use_cache=False))
    # ELECTRA's pre-training head: no loss type, no generation, a per-token loss: taken
    torch.manual_seed(0)
    electra = apply(transformers.ElectraForPreTraining(transformers.ElectraConfig(
        vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).eval(), layout="contiguous")
    out["electra labels"] = error_text(lambda: electra(
        **batch, labels=(batch["input_ids"] % 2).float()))
    return out


def test_masks_per_layer_type_and_a_default_causal_loss_are_checked_over_a_ring():
    """At W=2:
    - a mask given per layer type (transformers takes {"full_attention": ...,
      "sliding_attention": ...}) is checked for each type (before: at the first layer only,
      and a 4D mask for the second type was dropped without a word: 4.56 off);
    - labels given to GPT-2, whose loss type transformers maps to the causal-LM loss by
      default, are refused (before: only loss_type "ForCausalLM" was, and each rank computed
      another, wrong loss), and to an encoder-decoder without decoder inputs; ELECTRA's
      pre-training head, whose loss is per token, takes them."""
    for r in run_ranks(_per_type_mask_and_labels_ranks, 2, timeout=180):
        _assert_inexact(r, "mask for the second layer type", "Gemma3Attention",
                        "a 4D attention mask of shape (1, 1, 8, 16)")
        _assert_inexact(r, "gpt2 labels", "GPT2Attention",
                        "labels passed to the model over 2 ranks")
        _assert_inexact(r, "t5gemma labels alone", "T5GemmaSelfAttention",
                        "labels passed to the model over 2 ranks: its own loss (or an "
                        "encoder-decoder's decoder inputs made from them)")
        assert r["electra labels"] == "no error", r


def test_per_layer_kv_heads_are_no_error_of_apply():
    """Gemma 4 configs whose full-attention layers have their own K/V head count (transformers
    raises its RuntimeError when the count is read as one): apply switches the model, and it
    computes what eager attention does (before: apply raised transformers' error)."""
    from ringseq.integrations.transformers import apply
    cfg = transformers.Gemma4TextConfig(
        **SMALL, head_dim=16, global_head_dim=32,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], attention_k_eq_v=True,
        num_global_key_value_heads=1)
    ids = _ids()[:1, :12]
    logits = {}
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(0)
        model = transformers.Gemma4ForCausalLM(cfg).to(dtype).eval()
        model.set_attn_implementation("eager")
        with torch.no_grad():
            logits[dtype] = model(ids, use_cache=False).logits
    apply(model)  # (the float32 model)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    assert_close_per_design(got, logits[torch.float64], logits[torch.float32], "logits", 2.0,
                            scaled_floor(torch.float32, logits[torch.float64]))


class _CustomAttention(torch.nn.Module):
    """An attention module of the AttentionInterface look (a `scaling`, an *Attention name)
    whose forward calls SDPA itself, as a user's subclass may."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.scaling, self.config = inner, inner.scaling, inner.config

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        a, (b, s, _) = self.inner, hidden_states.shape
        q, k, v = (p(hidden_states).view(b, s, -1, a.head_dim).transpose(1, 2)
                   for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
        return a.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


_CustomAttention.__name__ = "MyLlamaAttention"


def test_an_attention_module_that_does_not_dispatch_is_refused_at_its_first_call():
    """Before: apply switched the config and the module, which then attended over its own
    shard alone on every rank (logits 0.22 off at W=2, no error). Its first call now raises;
    a model that dispatches keeps no hook after its first call. Not judged: calls while the
    model is switched to another implementation (sdpa to generate, as the README says) and
    an attention whose own forward is compiled (the count does not run in a graph)."""
    from ringseq.integrations.transformers import apply
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    apply(model)
    ids = _ids()[:1, :16]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        model(ids, use_cache=False)
        model.set_attn_implementation("ringseq")
        assert all(layer.self_attn._ringseq_dispatch_watch is not None
                   for layer in model.model.layers)
        model(ids, use_cache=False)
    assert all(layer.self_attn._ringseq_dispatch_watch is None for layer in model.model.layers)
    compiled = apply(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval())
    attention = compiled.model.layers[0].self_attn
    attention.forward = torch.compile(attention.forward, backend="eager")
    with torch.no_grad():
        compiled(ids, use_cache=False)
        compiled(ids, use_cache=False)
    custom = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    custom.model.layers[1].self_attn = _CustomAttention(custom.model.layers[1].self_attn)
    apply(custom)
    with pytest.raises(ValueError, match=r"^apply: MyLlamaAttention \(model\.layers\.\*\.self_attn"
                                         r"\) returned from its first call since apply without "
                                         r"calling ringseq's attention: its forward computes "
                                         r"attention itself"):
        with torch.no_grad():
            custom(ids, use_cache=False)


class _PlainLM(torch.nn.Module):
    """A plan's model of plain modules: embedding, one block of attention and MLP projections,
    LM head (no get_output_embeddings)."""

    def __init__(self):
        super().__init__()

        class Attention(torch.nn.Module):  # (an attention by its name and scale)
            def __init__(self):
                super().__init__()
                self.scaling = 8 ** -0.5
                self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32) for _ in range(4))

        layer = torch.nn.Module()
        layer.attn, layer.mlp = Attention(), torch.nn.Module()
        layer.mlp.up, layer.mlp.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.emb, self.layers = torch.nn.Embedding(16, 32), torch.nn.ModuleList([layer])
        self.head = torch.nn.Linear(32, 16)


def test_tp_plans_refuse_gathers_inside_blocks_and_mixtures_of_experts():
    """Before: 'colwise' on GLM-4's fused gate_up_proj ([gate | up] side by side; GLM-4
    declares it 'colwise_gather_output') was accepted, and each tp rank paired gate columns
    with gate columns (loss 4.899 against 5.224, no error); Mixtral, Qwen2-MoE and Qwen3-MoE
    passed boost and failed at their first forward inside DTensor; Phi-3's declared plan was
    refused naming its o_proj's style, and a 'colwise_gather_output' inside a block was
    dropped. Fused projections whose columns split by heads (GPT-NeoX's query_key_value,
    CodeGen's qkv_proj: declared 'colwise') and an LM head's gather stay accepted."""
    from ringseq.parallel.tp import resolve_tp_plan
    T = transformers
    torch.manual_seed(0)
    small = dict(SMALL, pad_token_id=0)
    attention = {f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"}
    attention["model.layers.*.self_attn.o_proj"] = "rowwise"
    glm4 = T.Glm4ForCausalLM(T.Glm4Config(**small))
    columns = r": its output columns do not split by heads .*Leave its block out of the plan"
    with pytest.raises(ValueError, match=r"^tensor parallelism: model\.layers\.0\.mlp\."
                                         r"gate_up_proj: the plan \(transformers config\) "
                                         r"gathers its output \('colwise_gather_output'\)"
                                         + columns):
        resolve_tp_plan(glm4, 2)
    with pytest.raises(ValueError, match=r"gate_up_proj: it is planned 'colwise', but "
                                         r"Glm4ForCausalLM declares it 'colwise_gather_output' "
                                         r"\(config\.base_model_tp_plan\)" + columns):
        resolve_tp_plan(glm4, 2, {**attention, "model.layers.*.mlp.gate_up_proj": "colwise",
                                  "model.layers.*.mlp.down_proj": "rowwise"})
    resolve_tp_plan(glm4, 2, attention)  # the MLP replicated: exact (checked at W=4 sp2 x tp2)
    for cls, config, name in ((T.Phi3ForCausalLM, T.Phi3Config, "self_attn.qkv_proj"),
                              (T.Olmo2ForCausalLM, T.Olmo2Config, "self_attn.q_proj")):
        with pytest.raises(ValueError, match=rf"^tensor parallelism: model\.layers\.0\.{name}: "
                                             rf"the plan .* gathers its output "
                                             rf"\('colwise_gather_output'\)" + columns):
            resolve_tp_plan(cls(config(**small)), 2)
    for cls, config in ((T.MixtralForCausalLM, T.MixtralConfig),
                        (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig)):
        with pytest.raises(ValueError, match=r"has mixture-of-experts layers \(model\.layers\.0"
                                             r"\.mlp, \w+SparseMoeBlock\).*instead of tp_size"):
            resolve_tp_plan(cls(config(**small)), 2)
    # expert counts in the config, dense layers only: trains as before (exact at tp 2)
    resolve_tp_plan(T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**small, num_experts=4,
                                                           mlp_only_layers=[0, 1])), 2)
    llama = T.LlamaForCausalLM(T.LlamaConfig(**small))
    resolve_tp_plan(llama, 2)
    resolve_tp_plan(llama, 2, {**attention, "lm_head": "colwise_gather_output"})
    resolve_tp_plan(T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=128)), 2)
    plain = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
             "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise",
             "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise",
             "emb": "embedding_rowwise", "head": "colwise_gather_output"}
    resolve_tp_plan(_PlainLM(), 2, plain)
