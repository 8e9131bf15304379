"""TRL's GRPO settings as the TRL translator knows them: the defaults of the keys it reads, the
settings with no equivalent, those with no effect here, and every argument TRL takes (:data:`KNOWN`).

The defaults are those of ``GRPOConfig`` (trl/trainer/grpo_config.py, with TRL's base config and
transformers' TrainingArguments under it), of ``ModelConfig`` (trl/trainer/model_config.py) and of
the ``trl grpo`` script's arguments (trl/scripts/grpo.py) at huggingface/trl commit f2cd577
(2026-07-24). Older TRL versions had other defaults (loss_type, beta, max_completion_length,
disable_dropout): give the ones your run used.
"""

from __future__ import annotations

DEFAULTS = {
    # the model and data (ModelConfig, the trl grpo script, GRPOTrainer's arguments)
    "model_name_or_path": None,
    "dtype": "float32",
    "attn_implementation": None,
    "model_init_kwargs": None,
    "trust_remote_code": False,
    "use_peft": False,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_modules": None,
    "dataset_name": None,
    "dataset_config": None,
    "dataset_train_split": "train",
    "reward_funcs": None,
    "reward_model_name_or_path": None,
    "reward_weights": None,
    "shuffle_dataset": True,
    "disable_dropout": False,
    # batch sizes and lengths
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
    "generation_batch_size": None,
    "steps_per_generation": None,
    "num_iterations": 1,
    "max_completion_length": 512,
    "max_prompt_length": None,  # removed from GRPOConfig; older versions: 512, prompts cut on the left
    "num_train_epochs": 3.0,
    "max_steps": -1,
    # sampling
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_tensor_parallel_size": 1,
    "vllm_max_model_length": None,
    "vllm_max_model_len": None,  # its older name
    "vllm_enable_sleep_mode": False,
    # the loss
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "importance_sampling_level": "token",
    "entropy_coef": 0.0,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_cap": None,
    # the optimizer
    "learning_rate": 1e-6,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "warmup_ratio": 0.0,
    "lr_scheduler_type": "linear",
    "optim": "adamw_torch_fused",
    "seed": 42,
    "bf16": None,  # None: true unless fp16
    "gradient_checkpointing": True,
    # logging and checkpoints
    "logging_steps": 10,
    "report_to": None,
    "run_name": None,
    "output_dir": None,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": None,
    "eval_strategy": "no",
    "eval_steps": None,
    "eval_on_start": False,
    "dataset_test_split": "test",
    "num_generations_eval": None,
}

#: settings with no equivalent: (TRL's default, why); reported when the value differs
LOST = {
    "delta": (None, "two-sided clipping is not available (clip_c bounds the loss of negative advantages only)"),
    "min_p": (None, "min-p sampling is not available"),
    "repetition_penalty": (1.0, "a repetition penalty is not available"),
    "generation_kwargs": (None, "other sampling arguments are not available"),
    "chat_template_kwargs": (None, "chat template arguments are not available"),
    "mask_truncated_completions": (False, "truncated responses stay in the loss"),
    "sync_ref_model": (False, "the reference stays the initial policy"),
    "top_entropy_quantile": (1.0, "every response token is in the loss"),
    "use_adaptive_entropy": (False, "the entropy coefficient is constant (algorithm.entropy_coeff)"),
    "off_policy_mask_threshold": (None, "off-policy sequence masking (DeepSeek-V3.2) is not available"),
    "use_bias_correction_kl": (False, "the KL term is not importance-weighted"),
    "multi_objective_aggregation": ("sum_then_normalize", "rewards are summed with weights, then normalised"),
    "max_tool_calling_iterations": (None, "tool calling: set up rollout.agent (docs/agents.md)"),
    "cast_lm_head_to_fp32": (False, "the output layer computes in the run's precision"),
    "fp16": (False, "float16 training is not available; bf16 mixed precision is"),
    "vllm_structured_outputs_regex": (None, "structured outputs are not available"),
    "adam_beta1": (0.9, "AdamW keeps torch's betas (0.9, 0.999)"),
    "adam_beta2": (0.999, "AdamW keeps torch's betas (0.9, 0.999)"),
    "adam_epsilon": (1e-8, "AdamW keeps torch's eps (1e-8)"),
    "lr_scheduler_kwargs": (None, "read with lr_scheduler_type: min_lr_rate (trainer.min_lr_ratio)"),
    "resume_from_checkpoint": (None, "resume reads the newest checkpoint of trainer.run_dir (--resume)"),
    "push_to_hub": (False, "'hybridrl export' writes a Hugging Face folder to push"),
    "dataset_streaming": (False, "the data is read as a whole"),
    "load_in_4bit": (False, "quantized training is not available"),
    "load_in_8bit": (False, "quantized training is not available"),
    "use_dora": (False, "DoRA is not available"),
    "use_rslora": (False, "rsLoRA is not available"),
    "lora_modules_to_save": (None, "LoRA trains the adapters only"),
    "lora_target_parameters": (None, "LoRA takes target_modules only"),
    "model_revision": ("main", "the model is the folder (or cached hub name) of model.path"),
    "router_aux_loss_coef": (0.001, "no MoE load-balancing loss is added"),
}

PERF = "performance settings; hybridrl chooses these itself, with the same results"
MACHINERY = "TRL's and transformers' machinery (loaders, hub, logging details)"
UNUSED = "settings of features this config does not use"
EVAL = "evaluation details hybridrl's data.eval decides itself"

IGNORED = {
    "logging_dir": MACHINERY,
    "logging_strategy": MACHINERY,
    "logging_first_step": MACHINERY,
    "log_completions": "rollout samples go to samples.jsonl every trainer.sample_every steps",
    "num_completions_to_print": MACHINERY,
    "log_unique_prompts": MACHINERY,
    "log_multimodal": MACHINERY,
    "log_completions_hub_repo": MACHINERY,
    "log_level": MACHINERY,
    "disable_tqdm": MACHINERY,
    "remove_unused_columns": MACHINERY,
    "ds3_gather_for_generation": PERF,
    "pad_to_multiple_of": PERF,
    "cache_implementation": PERF,
    "vllm_model_impl": PERF,
    "vllm_server_timeout": MACHINERY,
    "vllm_group_port": MACHINERY,
    "use_transformers_paged": PERF,
    "use_transformers_continuous_batching": PERF,
    "transformers_continuous_batching_config": PERF,
    "use_liger_kernel": PERF,
    "torch_compile": PERF,
    "tf32": PERF,
    "gradient_checkpointing_kwargs": PERF,
    "dataloader_num_workers": PERF,
    "dataloader_pin_memory": PERF,
    "dataloader_drop_last": MACHINERY,
    "dataloader_persistent_workers": PERF,
    "dataloader_prefetch_factor": PERF,
    "save_only_model": "trainer.save_final: weights saves the policy without the optimizer",
    "save_safetensors": MACHINERY,
    "overwrite_output_dir": MACHINERY,
    "do_train": MACHINERY,
    "hub_model_id": MACHINERY,
    "hub_strategy": MACHINERY,
    "hub_private_repo": MACHINERY,
    "hub_token": MACHINERY,
    "local_rank": MACHINERY,
    "ddp_timeout": "trainer.timeout_s bounds every collective",
    "ddp_find_unused_parameters": MACHINERY,
    "ddp_backend": MACHINERY,
    "fsdp": "sharding.strategy fsdp under torchrun",
    "fsdp_config": "sharding.strategy fsdp under torchrun",
    "deepspeed": "sharding.strategy fsdp under torchrun",
    "accelerator_config": MACHINERY,
    "env": MACHINERY,
    "lora_task_type": MACHINERY,
    "ignore_bias_buffers": MACHINERY,
    "sapo_temperature_neg": UNUSED,
    "sapo_temperature_pos": UNUSED,
    "vespo_k_pos": UNUSED,
    "vespo_lambda_pos": UNUSED,
    "vespo_k_neg": UNUSED,
    "vespo_lambda_neg": UNUSED,
    "ref_model_mixup_alpha": UNUSED,
    "ref_model_sync_steps": UNUSED,
    "entropy_coef_min": UNUSED,
    "entropy_coef_max": UNUSED,
    "entropy_coef_delta": UNUSED,
    "entropy_target": UNUSED,
    "per_device_eval_batch_size": EVAL,
    "eval_steps": EVAL,
    "eval_on_start": EVAL,
    "do_eval": EVAL,
}

#: TRL's other arguments: those of transformers' TrainingArguments (4.56.2, TRL's oldest, and 5.19.0)
#: and of GRPOConfig, ModelConfig, ScriptArguments and DatasetMixtureConfig at every TRL release from
#: v0.14.0 to v1.9.0 and at f2cd577; no rule reads them
OTHER = (
    "adafactor auto_find_batch_size average_tokens_across_devices batch_eval_metrics bf16_full_eval "
    "bnb_4bit_quant_storage bnb_4bit_quant_type data_seed dataloader_in_order dataloader_multiprocessing_context "
    "datasets ddp_broadcast_buffers ddp_bucket_cap_mb ddp_static_graph debug do_predict enable_jit_checkpoint "
    "eval_accumulation_steps eval_delay eval_do_concat_batches eval_use_gather_object fp16_backend fp16_full_eval "
    "fp16_opt_level fsdp_min_num_params fsdp_transformer_layer_cls_to_wrap full_determinism "
    "gradient_checkpointing_use_reentrant greater_is_better group_by_length half_precision_backend "
    "hub_always_push hub_revision ignore_data_skip include_for_metrics include_inputs_for_metrics "
    "include_num_input_tokens_seen include_tokens_per_second jit_mode_eval label_names label_smoothing_factor "
    "length_column_name liger_kernel_config load_best_model_at_end log_level_replica log_on_each_node "
    "logging_nan_inf_filter metric_for_best_model mp_parameters neftune_noise_alpha no_cuda optim_args "
    "optim_target_modules parallelism_config past_index per_gpu_eval_batch_size per_gpu_train_batch_size "
    "prediction_loss_only project push_to_hub_model_id push_to_hub_organization push_to_hub_token ray_scope "
    "restore_callback_states_from_checkpoint save_on_each_node skip_memory_metrics streaming test_split_size "
    "torch_compile_backend torch_compile_mode torch_empty_cache_steps torchdynamo tpu_metrics_debug tpu_num_cores "
    "trackio_bucket_id trackio_space_id trackio_static_space_id train_sampling_strategy use_bnb_nested_quant "
    "use_cache use_cpu use_ipex use_legacy_prediction_loop use_liger_loss use_mps_device vllm_device vllm_dtype "
    "vllm_enable_prefix_caching vllm_guided_decoding_regex wandb_log_unique_prompts"
).split()
#: every argument TRL takes (GRPOTrainer's model and train_dataset with them): another name is a typo,
#: which TRL's parser refuses too (TrlParser.parse_args_and_config, trl/scripts/utils.py)
KNOWN = {*DEFAULTS, *LOST, *IGNORED, *OTHER, "torch_dtype", "model", "train_dataset", "dataset"}
