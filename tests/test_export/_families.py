"""Tiny transformers models of many families (hidden 128, 1 layer, 4 experts, random init, no downloads): every
weight a whole number of 128x128 blocks, as FP8-block and INT4 (group 128) formats need."""

from __future__ import annotations

import copy

import torch
from torch import nn

H, I, V, E = 128, 128, 128, 4  # noqa: E741  (I: the intermediate size, as in the model configs)
_COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               head_dim=128, max_position_embeddings=64)
#: a config kwarg's value that drops the field from _COMMON (a config that derives it and has no setter, e.g. Falcon's head_dim)
UNSET = object()
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=I)
#: MLA (DeepSeek-V2/V3): q_a 128 rows, kv_a 128 + 128 (rope), kv_b's input 128: 128x128 blocks
_MLA = dict(num_key_value_heads=2, head_dim=128, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=128, qk_nope_head_dim=64,
            v_head_dim=64)
_ROPE = dict(rope_type="default", rope_theta=1e4)
#: MiMo-V2-Flash: per-layer-type rope (its default rotary fraction, 0.334, is no whole number of dims at head_dim 128)
_MIMO_ROPE = {t: dict(_ROPE, partial_rotary_factor=0.5) for t in ("full_attention", "sliding_attention")}
_SWA = ["sliding_attention", "full_attention"]
#: a Gated DeltaNet layer then an attention layer (linear attention heads of 64)
_GDN = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=64, linear_value_head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=2)
#: Qwen4-Exp: its attention layer indexed (QSA: one query head, blocks of 2 keys)
_GDN_QSA = dict(_GDN, layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=1, indexer_kv_heads=1, indexer_head_dim=128,
                indexer_budget=4, indexer_compress_ratio=2)
#: family -> (config class, model class, config kwargs); names as in ``transformers``
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_MOE, num_experts=E)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2, layer_types=["full_attention"])),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1,
                                                                      first_k_dense_replace=0, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1,
                                                                      first_k_dense_replace=0, n_group=1, topk_group=1)),
    # hybrid: a Gated DeltaNet layer (linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, conv1d) and a gated attention layer
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I,
                                                                          num_hidden_layers=2,
                                                                          layer_types=["linear_attention", "full_attention"],
                                                                          linear_key_head_dim=64, linear_value_head_dim=64,
                                                                          linear_num_key_heads=2, linear_num_value_heads=2)),
}  # fmt: skip


#: families beyond FAMILIES that only the export's name / load / logits check walks (their configs, tiny as above; classes
#: a transformers release lacks are skipped): dense ones of many lineages and more MoE layouts. GraniteMoE's checkpoint
#: stores its experts rearranged (``input_linear`` / ``output_linear``), which the export refuses by name, as it does
#: Llama-4's quantized experts (3-D (E, in, out) tensors: no format lays them out), GraniteMoE-SWA's (kept 3-D), a
#: quantized linear whose weight the checkpoint saves within another key (Param2 / Sarvam's q / k / v as one
#: query_key_value; unquantized tensors saved renamed or built are written so: test_families) and linears that read one input under leaf
#: names no layout knows (the DSA indexer's wk / weights_proj, MiniCPM5-MoE's q_gate_proj beside k_proj / v_proj,
#: RecurrentGemma's linear_x / linear_y), as it does quantized convolutions (3-D weights: the hybrids' mamba.conv1d, LFM2's
#: conv.conv) and Gemma-3n's 2 x 2 AltUp coefficients (no whole MX block).
MORE_FAMILIES = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(head_dim=64)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(pad_token_id=0)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {}),
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=E, num_experts_per_tok=2, num_attention_heads=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(_MOE, moe_num_experts=E, moe_k=2, moe_layer_start_index=0,
                                                                            moe_layer_end_index=0, moe_num_shared_experts=1)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0,
                                                              n_group=1, topk_group=1)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I,
                                                                    num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                                                    linear_key_head_dim=64, linear_value_head_dim=64,
                                                                    linear_num_key_heads=2, linear_num_value_heads=2)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2,
                                                                                       shared_intermediate_size=I)),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(num_local_experts=E, num_experts_per_tok=1, intermediate_size_mlp=I,
                                                                  moe_layers=[0], interleave_moe_layer_step=1, no_rope_layers=[1])),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(num_experts=E, num_experts_per_tok=2, num_hidden_layers=2, attn_layer_period=1,
                                                      attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=16,
                                                      mamba_expand=2, use_mamba_kernels=False)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2, layer_types=["full_attention"])),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(_MOE, num_experts=E, moe_topk=2, num_shared_expert=1)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                                                      topk_group=1)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(_MOE, num_experts=E, num_dense_layers=0, layer_types=["full_attention"])),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(_MOE, num_experts=E)),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(_MOE, num_experts=E)),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(_MOE, num_experts=E, num_dense_layers=0)),
    # DBRX: fused Wqkv (its forward needs clip_qkv and attn_config.rope_theta; head_dim = d_model / n_heads); its experts
    # (ffn.experts.mlp.w1 / v1 / w2, 2-D (E * ffn, d_model) parameters) have no quantized class and stay unquantized, so
    # two layers give the four quantized linears the load check asks for
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(d_model=H, head_dim=64, num_hidden_layers=2, ffn_config=dict(moe_num_experts=E,
                                                   moe_top_k=2, ffn_hidden_size=I), attn_config=dict(kv_n_heads=1, clip_qkv=8.0,
                                                                                                     rope_theta=1e4))),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(num_experts=E, num_experts_per_tok=2, pad_token_id=0)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1,
                                                                          mlp_layer_types=["sparse"])),
    # LongCat-Flash: num_hidden_layers is 2 * num_layers (one layer: two MLA sublayers, two dense MLPs, the shortcut MoE);
    # zero experts (identity) route beside the real ones
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, num_hidden_layers=2,
                                                                            zero_expert_num=E)),
    # DeepSeek sparse attention: the indexer's wq_b / wk / weights_proj beside MLA (index_topk below the sequence: sparse)
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1,
                                                                    first_k_dense_replace=0, index_n_heads=1, index_head_dim=128,
                                                                    index_topk=4)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1,
                                                                         first_k_dense_replace=0, n_group=1, topk_group=1,
                                                                         index_n_heads=1, index_head_dim=128, index_topk=4)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2,
                                                                                       shared_intermediate_size=I, num_hidden_layers=2,
                                                                                       layer_types=["linear_attention",
                                                                                                    "full_attention"],
                                                                                       mamba_n_heads=4, mamba_d_state=64)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2,
                                                                               shared_intermediate_size=I)),
    # Param2 and Sarvam-MoE: transformers runs them as Glm4MoeForCausalLM
    "param2moe": ("Param2MoeConfig", "Glm4MoeForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0)),
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0)),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1)),
    # Nemotron-H: one mixer per layer (Mamba-2, attention, MoE with non-gated up_proj / down_proj experts)
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1,
                                                                   moe_shared_expert_intermediate_size=I,
                                                                   layer_types=["linear_attention", "full_attention", "moe"],
                                                                   mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=64)),
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1,
                                                                         mlp_layer_types=["sparse"])),
    # older lineages: fused query_key_value (GPT-NeoX / Pythia, BLOOM, Persimmon, Falcon), Wqkv (MPT), qkv_proj (CodeGen),
    # multi-query c_attn (GPT-BigCode / StarCoder 1, nn.Linear), OPT-350m's project_in / project_out, Phi-2's dense / fc1 / fc2
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_inner=I)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=I, word_embed_proj_dim=2 * H, do_layer_norm_before=False)),
    "bloom": ("BloomConfig", "BloomForCausalLM", {}),
    # Falcon-7B (multi-query, parallel attention) and Falcon-40B / 180B (new_decoder_architecture: grouped kv) layouts;
    # its config derives head_dim (no setter)
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(ffn_hidden_size=I, head_dim=UNSET)),
    "falcon_new_arch": ("FalconConfig", "FalconForCausalLM", dict(ffn_hidden_size=I, head_dim=UNSET, new_decoder_architecture=True,
                                                                  num_kv_heads=1)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(expansion_ratio=1)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_inner=I)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_inner=I, multi_query=True)),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(head_dim=64)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),  # non-gated relu^2 up_proj / down_proj
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=64, num_key_value_heads=2)),  # o_proj: hidden -> hidden
    "glm": ("GlmConfig", "GlmForCausalLM", dict(pad_token_id=0)),  # fused mlp.gate_up_proj
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    # Mamba-2 (its mixer.conv1d the presets leave unquantized): in_proj's 2 * 128 + 2 * 32 + 64 heads rows are 3 blocks of 128
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(num_hidden_layers=2, num_heads=64, head_dim=2, expand=1, n_groups=1,
                                                         state_size=32, chunk_size=8)),
    # hybrids whose Mamba-2 / short convolution the presets quantize (mamba.conv1d, conv.conv: 3-D weights, refused by name);
    # with it off they export and load as saved. Zamba2: one shared transformer block (tied across its hybrid layers, one
    # LoRA adapter each: adapter_rank 256, so that an adapter's two linears, one of them unreached through each copy, have
    # inputs of different widths)
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                                                               mamba_d_state=64, mamba_expand=1, mamba_chunk_size=8)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                                                      mamba_n_groups=1, mamba_d_state=64, mamba_expand=1, mamba_chunk_size=8)),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(num_hidden_layers=3, layers_block_type=["hybrid", "mamba", "hybrid"],
                                                         mamba_d_state=64, n_mamba_heads=4, mamba_expand=1, use_mem_eff_path=False,
                                                         chunk_size=8, adapter_rank=2 * H, num_mem_blocks=1)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                                   block_auto_adjust_ff_dim=False)),
    # Gemma-3n text: AltUp's correction / prediction coefficients are (n, n) and (n * n, n) linears (n = altup_num_inputs)
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(hidden_size_per_layer_input=H, vocab_size_per_layer_input=V,
                                                               laurel_rank=H, num_kv_shared_layers=0, layer_types=["full_attention"],
                                                               altup_num_inputs=2, activation_sparsity_pattern=[0.0])),
    # Mamba-1 (and Jamba's Mamba layer, layer 0 here): its mixer multiplies by dt_proj.weight itself (quantized, refused by
    # name; off, the rest loads as saved)
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(num_hidden_layers=2, expand=1, state_size=16, time_step_rank=128,
                                                      use_mambapy=False)),
    "jamba_mamba": ("JambaConfig", "JambaForCausalLM", dict(num_experts=E, num_experts_per_tok=2, num_hidden_layers=2, attn_layer_period=2,
                                                            attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                                                            mamba_d_state=16, mamba_expand=1, mamba_dt_rank=128, use_mamba_kernels=False)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(num_hidden_layers=2, expand=1, state_size=16,
                                                                         time_step_rank=128)),
    # RecurrentGemma: the recurrent block's linear_x and linear_y read one input (and its conv_1d is quantized)
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(num_hidden_layers=2, lru_width=H, intermediate_size=2 * I,
                                                                                   block_types=["recurrent", "attention"])),
    # newest lineages. Gated DeltaNet + gated attention (Qwen3.5 dense); Gemma-4's per-layer inputs and a full-attention
    # layer whose k_proj gives the values too (attention_k_eq_v: no v_proj); MLA with MoE (Kimi-Linear's attention layer,
    # its block_sparse_moe experts; A.X-K1; MiniCPM3 and Youtu dense); MiMo-V2-Flash's full attention (v_head_dim apart)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _GDN),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        global_head_dim=128, hidden_size_per_layer_input=H, vocab_size_per_layer_input=V, attention_k_eq_v=True,
        num_global_key_value_heads=1)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(_MOE, **_MLA, num_local_experts=E, n_shared_experts=1, pad_token_id=0,
        layer_types=["full_attention"], mlp_layer_types=["sparse"])),
    "axk1": ("AXK1Config", "AXK1ForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1, n_group=1, topk_group=1,
        mlp_layer_types=["sparse"])),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(_MLA, head_dim=UNSET)),
    "youtu": ("YoutuConfig", "YoutuForCausalLM", dict(_MLA)),
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(_MOE, n_routed_experts=E, v_head_dim=128,
        mlp_layer_types=["sparse"], layer_types=["full_attention"], rope_parameters=_MIMO_ROPE)),
    "beam": ("BeamConfig", "BeamForCausalLM", dict(_MOE, num_experts=E, n_group=1, topk_group=1, mlp_layer_types=["sparse"])),
    "mellum": ("MellumConfig", "MellumForCausalLM", dict(_MOE, num_experts=E, mlp_layer_types=["sparse"])),
    # Dory: input, recurrent (looped twice) and output stacks of one layer each
    "dory": ("DoryConfig", "DoryForCausalLM", dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1, n_recurrent_loops=2)),
    "cwm": ("CwmConfig", "CwmForCausalLM", dict(num_hidden_layers=2, layer_types=_SWA, sliding_window=4)),
    "apertus1p5": ("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(num_hidden_layers=2, layer_types=_SWA, sliding_window=4)),
    # its config derives head_dim (hidden / heads); its full-attention layer has no position embeddings
    "cohere_compass": ("CohereCompassTextConfig", "CohereCompassForCausalLM", dict(num_attention_heads=1, num_hidden_layers=2,
        sliding_window=4, layer_types=_SWA, rope_parameters={"full_attention": None, "sliding_attention": _ROPE})),
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {}),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(num_hidden_layers=2, layer_types=_SWA, sliding_window=4)),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2)),
    # JetMoE: its attention and MLP experts (JetMoeParallelExperts) have no quantized class, so only kv_proj is quantized: four
    # layers give the four quantized linears the load check asks for
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2, kv_channels=128,
        num_attention_heads=UNSET, head_dim=UNSET, num_hidden_layers=4)),
    # checkpoint tensors renamed (DeepSeek-V4's hyper-connections, HY-V4's head, sinks of MiMo-V2-Flash's sliding layers and
    # Flint's, the router bias of HY-V3 / Bailing / Kolibri, Ergo's residual gate): written under their keys. Refused
    # (MORE_REFUSED): 3-D experts (Gemma-4 MoE, Mistral-4), quantized linears saved within a key built of several (HRM-Text's
    # gqkv_proj, LaraMini's in_proj), Ergo's shared experts saved transposed, linears that read one input under leaf names no
    # layout knows, and the DSA indexer
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, layer_types=["sliding_attention"], mlp_layer_types=["moe"], sliding_window=4)),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1, mlp_layer_types=["sparse"],
        index_n_heads=1, index_head_dim=128, index_topk=4, hc_mult=2, pad_token_id=0)),
    "mimo_v2_flash_swa": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(v_head_dim=128, layer_types=["sliding_attention"],
        sliding_window=4, mlp_layer_types=["dense"], rope_parameters=_MIMO_ROPE)),
    "flint": ("FlintConfig", "FlintForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I, pad_token_id=0)),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", dict(_MOE, num_experts=E, num_shared_experts=1, mlp_layer_types=["sparse"])),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(_MOE, **_MLA, num_local_experts=E, n_shared_experts=1,
        n_group=1, topk_group=1, layer_types=["full_attention"], mlp_layer_types=["sparse"], pad_token_id=0)),
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I)),
    "ergo": ("ErgoConfig", "ErgoForCausalLM", dict(_MOE, num_experts=E, first_dense_intermediate_size=I, shared_intermediate_size=I,
        num_dense_blocks=0, head_dim=UNSET, num_attention_heads=1)),
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(layer_types=["full_attention"], global_head_dim=128,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=E, top_k_experts=2, moe_intermediate_size=I)),
    # Mistral-4: MLA with qk_rope_head_dim 64 (its yarn rope needs a rotary fraction that is a whole number of dims)
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(_MOE, **dict(_MLA, qk_rope_head_dim=64), n_routed_experts=E,
        n_shared_experts=1, first_k_dense_replace=0, pad_token_id=0)),
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", {}),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", dict(_MOE, **_GDN, num_experts=E, shared_expert_intermediate_size=I)),
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM", dict(_MOE, n_routed_experts=E, num_hidden_layers=2, eos_token_id=1,
        layer_types=["hybrid_sliding", "hybrid"], swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=128,
        sliding_window_size=4, rel_extent=16, log_scaling_n_floor=4, unpadded_vocab_size=V, n_layers_per_attn_res_block=1)),
    "axk2": ("AXK2Config", "AXK2ForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1, n_group=1, topk_group=1,
        mlp_layer_types=["sparse"], index_n_heads=1, index_head_dim=128, index_topk=4)),
    # Qwen4-Exp: a Gated DeltaNet layer and an indexed attention layer (QSA indexer), hyper-connections of 2 streams
    "qwen4_exp": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(_MOE, **_GDN_QSA, num_experts=E, shared_expert_intermediate_size=I,
        hc_count=2, hc_lowrank=128)),
    "kimi_linear_kda": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(_MOE, **_MLA, num_local_experts=E, n_shared_experts=1,
        pad_token_id=0, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
        linear_head_dim=64, linear_num_heads=2)),
    "dots3_note": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", dict(_MOE, **_MLA, n_routed_experts=E, n_shared_experts=1, use_dsa=False,
        shared_experts_intermediate_size=I, mlp_layer_types=["sparse"], layer_types=["full_attention"], pad_token_id=0)),
    "inkling": ("InklingTextConfig", "InklingForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"], swa_num_attention_heads=2,
        swa_num_key_value_heads=1, swa_head_dim=128, sliding_window_size=4, rel_extent=16, pad_token_id=0)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(_GDN, pad_token_id=0)),
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", dict(num_hidden_layers=2, layer_types=_SWA, sliding_window=4, pad_token_id=0)),
    "laguna": ("LagunaConfig", "LagunaForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I, mlp_layer_types=["sparse"],
        pad_token_id=0)),
    "zaya": ("ZayaConfig", "ZayaForCausalLM", dict(_MOE, num_experts=E, router_hidden_size=H, num_experts_per_tok=1)),
}  # fmt: skip
#: the words of a refusal of quantized experts that a family's checkpoint keeps 3-D (as they are, or rearranged on save)
_KEPT_3D = "transformers' {} checkpoint keeps model.layers.0.block_sparse_moe.experts.gate_up_proj as one 3-D tensor"
_QKV_BUILT = (r"self_attn.v_proj.weight_quantizer\): transformers saves these weights as one key, model.layers.0.attention.query_key_value"
              r"\.weight, and format hf_mxfp8 has no consumer that reads it quantized \(transformers 5.25 loads")
_INDEXER = r"indexer.weights_proj.weight_quantizer is enabled \(mx\), but the sparse-attention indexer's weights_proj is loaded only"
_CONV = r"mamba.conv1d.weight_quantizer: a 3-D weight \(256, 1, 4\); export formats carry 2-D linear weights"
#: MORE_FAMILIES whose export is refused, and the words of the refusal
MORE_REFUSED = {"granitemoe": _KEPT_3D.format("granitemoe"),
                "granitemoeshared": _KEPT_3D.format("granitemoeshared"),
                "llama4_text": "experts.gate_up_proj_weight_quantizer is enabled, and the export has no layout",
                "granitemoehybrid": _KEPT_3D.format("granitemoehybrid"),
                "granitemoe_swa": "granitemoe_swa checkpoint keeps model.layers.0.block_sparse_moe.experts.gate_up_proj as one 3-D tensor",
                # vLLM fuses the DSA indexer's wk and weights_proj unquantized (test_families: with weights_proj off, both load as saved)
                "deepseek_v32": _INDEXER, "glm_moe_dsa": _INDEXER,
                # a convolution's weight is 3-D in the checkpoint (channels, 1, kernel): no format carries it quantized
                "falcon_h1": _CONV, "bamba": _CONV, "zamba2": _CONV,
                "lfm2": r"model.layers.0.conv.conv.weight_quantizer: a 3-D weight \(128, 1, 3\); export formats carry 2-D linear weights",
                "mamba": r"backbone.layers.0.mixer.dt_proj.weight_quantizer is enabled, but MambaMixer reads dt_proj.weight directly",
                "jamba_mamba": r"model.layers.0.mamba.dt_proj.weight_quantizer is enabled, but JambaMambaMixer reads dt_proj.weight",
                "falcon_mamba": r"backbone.layers.0.mixer.dt_proj.weight_quantizer is enabled, but FalconMambaMixer reads dt_proj.weight",
                # a 2 x 2 linear is no whole number of MX blocks (1 x 32)
                "gemma3n": r"model.layers.0.altup.correction_coefs.weight_quantizer: weight 2x2 is not a whole number of 1x32 blocks",
                "recurrent_gemma": r"model.layers.0.temporal_block.conv_1d.weight_quantizer: a 3-D weight \(128, 1, 4\)",
                "gemma4_moe": r"transformers' gemma4_text checkpoint keeps model.layers.0.experts.gate_up_proj as one 3-D tensor",
                "mistral4": r"transformers' mistral4 checkpoint keeps model.layers.0.mlp.experts.gate_up_proj as one 3-D tensor",
                # the checkpoint fuses what the model computes apart (Inkling-2: lm_head padded to vocab_size on save)
                "hrm_text": r"v_proj.weight_quantizer\): transformers saves these weights as one key, model.L_module.layers.0.attn"
                            r"\.gqkv_proj\.weight, and format hf_mxfp8 has no consumer",
                "lara_mini": r"saves model.layers.0.linear_attn.in_proj_qkv.weight within model.layers.0.linear_attn.in_proj.weight with "
                             r"\['model.layers.0.linear_attn.in_proj_b.weight', 'model.layers.0.linear_attn.in_proj_a.weight'\], "
                             r"which are not quantized",
                "inkling2": r"transformers' inkling2_text checkpoint keeps model.layers.0.mlp.experts.gate_up_proj as one 3-D tensor",
                # q / k / v (q_proj / k_proj / v_proj) saved as one query_key_value (test_families: with them off, both load)
                "param2moe": _QKV_BUILT, "sarvam_moe": _QKV_BUILT,
                "hy_v4": _INDEXER,
                # the shared experts' weights are saved transposed (shared_up_proj), and .scale tensors read as block scales
                "ergo": r"shared_experts.up_proj.weight_quantizer is enabled, but transformers saves model.layers.0.mlp.shared_experts"
                        r".up_proj.weight as layers.0.feed_forward.shared_up_proj rearranged \(transposed or reshaped on save\)",
                "axk2": _INDEXER,
                # transformers' fine-grained FP8 loader pairs block_inject_weight.weight with no scale (test_families: ct_mxfp8)
                "qwen4_exp": r"block_inject_weight.weight_quantizer: written as model.layers.0.attn_hyper_connection.block_inject_weight"
                             r".weight, but transformers' fine-grained FP8 loader pairs a weight",
                # its q / k / v short convolutions are one conv1d, split on save
                "kimi_linear_kda": r"self_attn.conv1d.weight_quantizer is enabled, but transformers saves model.layers.0.self_attn.conv1d"
                                   r".weight as model.layers.0.self_attn.q_conv1d.weight rearranged \(split on save\)",
                "inkling": r"transformers' inkling_text checkpoint keeps model.layers.1.mlp.experts.gate_up_proj as one 3-D tensor",
                "zaya": r"transformers' zaya checkpoint keeps model.layers.0.mlp.experts.gate_up_proj as one 3-D tensor"}
#: MORE_FAMILIES that the family x format matrix walks too (MoE layouts of other lineages; Phi-3's fused qkv_proj and
#: gate_up_proj), with their fused groups as FAMILY_GROUPS names them
MORE_GROUPS = {"phi3": (), "olmoe": ("attn",), "ernie4_5_moe": ("attn", "shared"), "glm4_moe": ("attn", "shared"),
               "qwen3_next": ("attn1", "shared_expert")}


#: fused groups (what vLLM loads as one GEMM): one attention's q/k/v, the MLP's gate/up, MLA's q_a / kv_a, shared experts,
#: the Gated DeltaNet's in_proj_qkv / in_proj_z
GROUPS = {
    "attn": ("model.layers.0.self_attn.{}", ("q_proj", "k_proj", "v_proj")),
    "attn1": ("model.layers.1.self_attn.{}", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("model.layers.0.mlp.{}", ("gate_proj", "up_proj")),
    "mla": ("model.layers.0.self_attn.{}", ("q_a_proj", "kv_a_proj_with_mqa")),
    "shared": ("model.layers.0.mlp.shared_experts.{}", ("gate_proj", "up_proj")),
    "shared_expert": ("model.layers.0.mlp.shared_expert.{}", ("gate_proj", "up_proj")),
    "gdn": ("model.layers.0.linear_attn.{}", ("in_proj_qkv", "in_proj_z")),
}
FAMILY_GROUPS = {
    "llama": ("attn", "mlp"), "mistral": ("attn", "mlp"), "qwen2": ("attn", "mlp"), "qwen3": ("attn", "mlp"), "gemma": ("attn", "mlp"),
    "qwen2_moe": ("attn", "shared_expert"), "qwen3_moe": ("attn",), "mixtral": ("attn",), "phimoe": ("attn",), "gpt_oss": ("attn",),
    "deepseek_v2": ("mla", "shared"), "deepseek_v3": ("mla", "shared"), "qwen3_5_moe": ("gdn", "attn1", "shared_expert"),
}  # fmt: skip


def spec(family: str) -> tuple[str, str, dict]:
    """``family``'s (config class, model class, config kwargs), from FAMILIES or MORE_FAMILIES."""
    return FAMILIES[family] if family in FAMILIES else MORE_FAMILIES[family]


def is_moe(family: str) -> bool:
    """Whether ``family``'s tiny model has routed experts (its config names their count)."""
    return bool({"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"} & set(spec(family)[2]))


def built_here(family: str) -> bool:
    """Whether the installed transformers has ``family``'s config and model classes."""
    import transformers

    cfg_cls, model_cls, _ = spec(family)
    return hasattr(transformers, cfg_cls) and hasattr(transformers, model_cls)


def build(family: str, tie: bool = False, seed: int = 0, **overrides) -> nn.Module:
    """A tiny ``family`` causal LM in eval mode (experts run eager, as the quantized model computes them);
    ``overrides`` replace config fields (e.g. ``hidden_size=128`` for formats with blocks of 128)."""
    import transformers

    cfg_cls, model_cls, extra = spec(family)
    extra = copy.deepcopy(extra, {id(UNSET): UNSET})  # a config may change the dicts it is given (rope parameters)
    kwargs = {k: v for k, v in {**_COMMON, **extra, "tie_word_embeddings": tie, **overrides}.items() if v is not UNSET}
    if is_moe(family):
        kwargs["experts_implementation"] = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval()
    with torch.no_grad():  # parameters of different magnitudes: a shared or a neighbour's scale shows
        for i, p in enumerate(model.parameters()):
            if p.dim() >= 2:
                p.mul_(1.0 + 0.37 * (i % 5))
    return model


def gpt2(tie: bool = True, seed: int = 0) -> nn.Module:
    """A tiny GPT-2 (``Conv1D`` linears, fused ``c_attn``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=H, n_layer=1, n_head=2, n_positions=64, tie_word_embeddings=tie)).eval()


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed))
