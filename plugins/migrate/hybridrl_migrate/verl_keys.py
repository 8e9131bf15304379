"""verl's settings as the verl translator knows them: the defaults of the keys it reads, the
settings with no equivalent, those with no effect here, and every key verl has (:data:`KNOWN`).

The defaults are those of verl's ``verl/trainer/config/_generated_ppo_trainer.yaml`` (the whole
``ppo_trainer.yaml`` flattened) at volcengine/verl commit b178a3c (2026-01-29), and of its DAPO
recipe for ``algorithm.filter_groups`` and ``reward_model.overlong_buffer``.
"""

from __future__ import annotations

from hybridrl_migrate.common import tree_keys

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = "actor_rollout_ref.model"
C = "critic"

#: verl's defaults of the keys the translator reads (a key the user leaves out takes these)
DEFAULTS = {
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.prompt_key": "prompt",
    "data.reward_fn_key": "data_source",
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.shuffle": True,
    "data.seed": None,
    "data.train_max_samples": -1,
    "data.truncation": "error",
    "data.filter_overlong_prompts": False,
    f"{M}.path": "~/models/deepseek-llm-7b-chat",
    f"{M}.trust_remote_code": False,
    f"{M}.enable_gradient_checkpointing": True,
    f"{M}.lora_rank": 0,
    f"{M}.lora_alpha": 16,
    f"{M}.target_modules": "all-linear",
    f"{A}.strategy": "fsdp",
    f"{A}.ppo_mini_batch_size": 256,
    f"{A}.ppo_micro_batch_size": None,
    f"{A}.ppo_micro_batch_size_per_gpu": None,
    f"{A}.use_dynamic_bsz": False,
    f"{A}.ppo_max_token_len_per_gpu": 16384,
    f"{A}.clip_ratio": 0.2,
    f"{A}.clip_ratio_low": 0.2,
    f"{A}.clip_ratio_high": 0.2,
    f"{A}.clip_ratio_c": 3.0,
    f"{A}.policy_loss.loss_mode": "vanilla",
    f"{A}.loss_agg_mode": "token-mean",
    f"{A}.loss_scale_factor": None,
    f"{A}.entropy_coeff": 0,
    f"{A}.use_kl_loss": False,
    f"{A}.kl_loss_coef": 0.001,
    f"{A}.kl_loss_type": "low_var_kl",
    f"{A}.ppo_epochs": 1,
    f"{A}.grad_clip": 1.0,
    f"{A}.optim.lr": 1e-6,
    f"{A}.optim.weight_decay": 0.01,
    f"{A}.optim.lr_warmup_steps": -1,
    f"{A}.optim.lr_warmup_steps_ratio": 0.0,
    f"{A}.optim.lr_scheduler_type": "constant",
    f"{A}.optim.warmup_style": None,
    f"{A}.optim.betas": [0.9, 0.999],
    f"{A}.optim.optimizer": "AdamW",
    f"{A}.fsdp_config.param_offload": False,
    f"{A}.fsdp_config.optimizer_offload": False,
    f"{A}.fsdp_config.reshard_after_forward": True,
    f"{A}.fsdp_config.fsdp_size": -1,
    f"{A}.fsdp_config.model_dtype": "fp32",
    f"{A}.fsdp_config.dtype": "bfloat16",
    f"{R}.name": None,  # '???' in verl: required
    f"{R}.temperature": 1.0,
    f"{R}.top_k": -1,
    f"{R}.top_p": 1.0,
    f"{R}.n": 1,
    f"{R}.do_sample": True,
    f"{R}.gpu_memory_utilization": 0.5,
    f"{R}.tensor_model_parallel_size": 2,
    f"{R}.dtype": "bfloat16",
    f"{R}.ignore_eos": False,
    f"{R}.response_length": "${oc.select:data.max_response_length,512}",
    f"{R}.multi_turn.enable": False,
    f"{C}.optim.lr": 1e-5,
    f"{C}.optim.weight_decay": 0.01,
    f"{C}.grad_clip": 1.0,
    f"{C}.ppo_mini_batch_size": f"${{oc.select:{A}.ppo_mini_batch_size,256}}",
    f"{C}.ppo_micro_batch_size": None,
    f"{C}.ppo_micro_batch_size_per_gpu": "${oc.select:.ppo_micro_batch_size,null}",
    f"{C}.ppo_epochs": f"${{oc.select:{A}.ppo_epochs,1}}",
    f"{C}.cliprange_value": 0.5,
    f"{C}.loss_agg_mode": f"${{oc.select:{A}.loss_agg_mode,token-mean}}",
    f"{C}.model.trust_remote_code": f"${{oc.select:{M}.trust_remote_code,false}}",
    "reward_model.enable": False,
    "reward_model.model.path": "~/models/FsfairX-LLaMA3-RM-v0.1",
    "reward_model.model.trust_remote_code": False,
    "reward_model.micro_batch_size_per_gpu": None,
    "reward_model.max_length": None,
    "reward_model.reward_manager": "naive",
    "reward_model.overlong_buffer.enable": False,
    "reward_model.overlong_buffer.len": 0,
    "reward_model.overlong_buffer.penalty_factor": 0.0,
    "custom_reward_function.path": None,
    "custom_reward_function.name": "compute_score",
    "custom_reward_function.reward_kwargs": {},
    "algorithm.adv_estimator": "gae",
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.rollout_rs": None,
    "algorithm.rollout_correction.rollout_rs_threshold": None,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": None,
    "algorithm.filter_groups.enable": False,
    "algorithm.filter_groups.max_num_gen_batches": 0,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.val_before_train": True,
    "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    "trainer.resume_mode": "auto",
    "trainer.max_actor_ckpt_to_keep": None,
    "trainer.device": "cuda",
    "trainer.use_legacy_worker_impl": "auto",
    "actor_rollout_ref.nccl_timeout": 600,
}

#: where verl 0.9 moved the keys the translator reads (its ``reward`` section): new key: the key above
MOVED = {
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
}

#: settings with no equivalent: (verl's default, why); reported when the value differs
LOST = {
    f"{A}.ulysses_sequence_parallel_size": (1, "sequence parallelism (Ulysses) is not available"),
    f"{C}.ulysses_sequence_parallel_size": (1, "sequence parallelism (Ulysses) is not available"),
    f"{A}.router_replay.mode": ("disabled", "MoE routing replay is not available"),
    f"{R}.enable_rollout_routing_replay": (False, "MoE routing replay is not available"),
    f"{A}.fsdp_config.full_determinism": (False, "no full-determinism mode"),
    f"{A}.optim.override_optimizer_config": (None, "the optimizer is AdamW with torch's settings"),
    f"{A}.checkpoint.save_contents": (
        ["model", "optimizer", "extra"],
        "checkpoints hold everything a resume needs (trainer.save_final: weights drops the optimizer); "
        "'hybridrl export' writes a Hugging Face folder",
    ),
    f"{M}.lora_adapter_path": (None, "starting from a saved LoRA adapter is not available"),
    f"{M}.exclude_modules": (None, "LoRA takes target_modules only"),
    f"{M}.custom_chat_template": (None, "the tokenizer's own chat template is used"),
    f"{M}.override_config": ({}, "model config overrides are not available"),
    f"{M}.external_lib": (None, "import the library in a plugin instead"),
    f"{M}.tokenizer_path": (None, "the tokenizer is the model's"),
    f"{M}.hf_config_path": (None, "the model config is the model folder's"),
    f"{M}.mtp.enable": (False, "multi-token prediction is not available"),
    f"{R}.over_sample_rate": (0, "over-sampling is not available"),
    f"{R}.quantization": (None, "quantized rollouts: give vLLM's quantization in rollout.engine_kwargs"),
    f"{R}.agent.default_agent_loop": (
        "single_turn_agent",
        "verl's agent loops: hybridrl's rollout.agent (docs/agents.md) is set up by hand",
    ),
    f"{R}.agent.agent_loop_config_path": (None, "verl's agent loops: see rollout.agent (docs/agents.md)"),
    "data.custom_cls.path": (None, "a custom dataset class: write a prompt source plugin (docs/plugins.md)"),
    "data.datagen.path": (None, "generated data: write a prompt source plugin (docs/plugins.md)"),
    "data.sampler.class_path": (None, "curriculum samplers are not available"),
    "data.apply_chat_template_kwargs": ({}, "chat template arguments are not available"),
    "data.tokenizer": (None, "the tokenizer is the model's"),
    "data.gen_batch_size": (None, "rollout.refill_rounds draws more rounds of prompts_per_step prompts instead"),
    "reward_model.sandbox_fusion.url": (None, "code rewards through SandboxFusion are not available"),
    "reward_manager.module.path": (None, "a custom reward manager: write a reward plugin (docs/plugins.md)"),
    "reward.reward_manager.module.path": (None, "a custom reward manager: write a reward plugin (docs/plugins.md)"),
    "distillation.enabled": (False, "distillation from teacher models is not available"),
    "trainer.v1.trainer_mode": (
        "sync",
        "verl's asynchronous trainer modes are not available: a step rolls out, then trains",
    ),
    f"{R}.full_determinism": (False, "no full-determinism mode"),
    f"{A}.optim.zero_indexed_step": (True, "hybridrl's warm-up counts steps from 1 (docs/migrating.md)"),
    f"{A}.qat.enable": (False, "quantization-aware training is not available"),
    f"{A}.fsdp_config.qat.enable": (False, "quantization-aware training is not available"),
    f"{M}.lora.rank": (0, "verl 0.10's LoRA section: set model.lora by hand (lora_rank, lora_alpha are translated)"),
    "trainer.resume_from_path": (None, "resume reads the newest checkpoint of trainer.run_dir"),
    "trainer.val_only": (False, "a run trains; evaluation alone is not available"),
    "trainer.log_val_generations": (0, "evaluation responses are not sent to the trackers"),
    "trainer.rollout_data_dir": (
        None,
        "samples.jsonl in the run directory holds rollout samples every trainer.sample_every steps",
    ),
    "trainer.critic_warmup": (0, "no critic-only warm-up steps (docs/algorithms.md)"),
    "algorithm.use_pf_ppo": (False, "PF-PPO's reweighting is not available"),
    "algorithm.rollout_correction.bypass_mode": (False, "the correction always recomputes old logprobs"),
    "algorithm.rollout_correction.loss_type": ("ppo_clip", "the corrected loss is the clipped one"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": (False, "IS weights are not normalised"),
    "algorithm.filter_groups.metric": (None, "dynamic sampling looks at the combined score"),
    f"{C}.model.lora_rank": (0, "the critic trains every weight"),
    f"{C}.model.override_config": ({}, "model config overrides are not available"),
    f"{C}.model.external_lib": (None, "import the library in a plugin instead"),
    f"{C}.optim.lr_warmup_steps": (-1, "the critic's learning rate has no warm-up"),
    f"{C}.optim.lr_warmup_steps_ratio": (0.0, "the critic's learning rate has no warm-up"),
    f"{C}.optim.lr_scheduler_type": ("constant", "the critic's learning rate is constant"),
    f"{C}.optim.warmup_style": (None, "the critic's learning rate is constant"),
    f"{C}.optim.betas": ([0.9, 0.999], "the critic's AdamW has torch's betas (0.9, 0.999)"),
    f"{C}.optim.optimizer": ("AdamW", "the critic's optimizer is AdamW"),
    f"{C}.optim.override_optimizer_config": (None, "the critic's optimizer is AdamW with torch's settings"),
}

PERF = "performance settings; hybridrl chooses these itself, with the same results"
MACHINERY = "verl's machinery (Ray, workers, config classes, profilers)"
EVAL = "evaluation details hybridrl's data.eval decides itself"
MEDIA = "multi-modal inputs are not available"
UNUSED = "settings of features this config does not use"

#: settings with no effect on what is trained, by key prefix ('*.part': that part anywhere)
IGNORED = {
    **dict.fromkeys(
        (
            "*._target_ *.profiler *.prometheus *.trace global_profiler transfer_queue ray_kwargs reward_manager "
            f"reward.num_workers reward.reward_manager.source {R}.mode {R}.agent {R}.checkpoint_engine "
            f"{R}.load_format {R}.layered_summon {R}.skip_rollout {R}.skip_dump_dir {R}.skip_tokenizer_init "
            f"{R}.calculate_log_probs {R}.disable_log_stats {R}.multi_stage_wake_up *.forward_only "
            "*.optim.optimizer_impl data.return_raw_input_ids data.return_raw_chat data.return_full_prompt "
            "data.trust_remote_code trainer.esi_redundant_time trainer.ray_wait_register_center_timeout "
            "trainer.use_legacy_worker_impl trainer.default_hdfs_dir trainer.del_local_ckpt_after_load "
            "reward_model.model.external_lib reward_model.model.override_config reward_model.use_reward_loop "
            "reward_model.reward_loop_source reward_model.reward_loop_module_path "
            "reward_model.reward_loop_class_name reward_model.overlong_buffer.log skip *.layer_name_map trainer.use_v1 "
            f"{R}.nnodes {R}.n_gpus_per_node {R}.moe_load_balance_metrics_interval reward.reward_manager.module"
        ).split(),
        MACHINERY,
    ),
    "*.router_replay": "MoE routing replay is not available",
    **dict.fromkeys(
        (
            f"*.sandbox_fusion {R}.multi_turn *.mtp {R}.quantization_config_file *.qat *.lora distillation trainer.v1 "
            "data.function_tool_path "
            "data.tool_config_path data.custom_cls data.datagen data.sampler algorithm.pf_ppo "
            f"{C}.model.lora_alpha {C}.model.target_modules"
        ).split(),
        UNUSED,
    ),
    "actor_rollout_ref.hybrid_engine": "the engine always shares the policy's GPUs (hybrid engine)",
    f"{R}.logprobs_mode": "the engines report processed logprobs, as the trainer scores them",
    f"{R}.free_cache_engine": "the engine sleeps during training where that memory is needed (vllm sleep_level: auto)",
    f"{R}.prompt_length": "data.max_prompt_length bounds prompts",
    "*.rollout_n": "rollout.n",
    **dict.fromkeys(
        (
            f"{R}.val_kwargs data.val_batch_size data.val_max_samples data.validation_shuffle "
            "trainer.validation_data_dir"
        ).split(),
        EVAL,
    ),
    **dict.fromkeys(
        (
            f"{R}.cudagraph_capture_sizes {R}.data_parallel_size {R}.expert_parallel_size "
            f"{R}.pipeline_model_parallel_size {R}.max_num_batched_tokens {R}.max_num_seqs "
            f"{R}.enable_chunked_prefill {R}.enable_prefix_caching {R}.scheduling_policy {R}.enforce_eager "
            f"{R}.max_model_len {R}.engine_kwargs *.log_prob_use_dynamic_bsz *.log_prob_max_token_len_per_gpu "
            "*.forward_micro_batch_size *.forward_micro_batch_size_per_gpu *.forward_max_token_len_per_gpu "
            "*.use_fused_kernels *.fused_kernel_options *.use_liger *.use_torch_compile "
            "*.entropy_from_logits_with_chunking *.entropy_checkpointing *.calculate_entropy "
            "*.calculate_sum_pi_squared *.sum_pi_squared_checkpointing *.enable_activation_offload *.tiled_mlp "
            f"*.use_shm *.wrap_policy *.forward_prefetch *.use_orig_params *.offload_policy {M}.use_fused_kernels "
            "data.dataloader_num_workers data.filter_overlong_prompts_workers trainer.balance_batch "
            "reward_model.use_dynamic_bsz reward_model.launch_reward_fn_async "
            "reward_model.ulysses_sequence_parallel_size reward_model.num_workers reward_model.micro_batch_size"
        ).split(),
        PERF,
    ),
    **dict.fromkeys(
        ("*.log_prob_micro_batch_size *.log_prob_micro_batch_size_per_gpu").split(),
        "the logprob passes use trainer.micro_batch_size / micro_batch_tokens",
    ),
    "*.use_remove_padding": "trainer.pack_sequences (auto) packs sequences by itself",
    "*.use_prefix_grouper": "trainer.share_prompts (auto) runs shared prompts once by itself",
    "*.strategy": "sharding.strategy follows the actor's",
    **dict.fromkeys(
        ("*.seed *.data_loader_seed").split(),
        "trainer.seed (data.seed)",
    ),
    "*.shuffle": "mini-batches are shuffled when a step has several",
    "*.checkpoint": "checkpoints hold everything a resume needs",
    "*.optim.total_training_steps": "trainer.steps",
    "*.optim.min_lr_ratio": "used with a cosine schedule (trainer.min_lr_ratio); the critic's rate is constant",
    "*.optim.num_cycles": "used with a cosine schedule; the critic's rate is constant",
    **dict.fromkeys(
        (
            "*.freeze_vision_tower data.image_key data.video_key data.audio_key data.image_patch_size "
            "data.return_multi_modal_inputs data.mm_processor_kwargs"
        ).split(),
        MEDIA,
    ),
    "actor_rollout_ref.ref": "the reference is the initial policy, sharded like it",
    f"{A}.fsdp_config.ulysses_sequence_parallel_size": "sequence parallelism (Ulysses) is not available",
    **dict.fromkeys(
        (f"{A}.policy_loss {A}.tau_pos {A}.tau_neg").split(),
        "parameters of loss modes this config does not use",
    ),
    "trainer.max_critic_ckpt_to_keep": "trainer.keep_last keeps the critic with the policy",
    f"{C}.model.fsdp_config": "the critic is sharded like the policy (sharding)",
    f"{C}.fsdp": "the critic is sharded like the policy (sharding)",
    "*.megatron": "Megatron's parallelism: sharding.strategy fsdp shards by itself",
    **dict.fromkeys(
        (
            "*.turbo_config *.disaggregation *.entropy_from_logits_chunk_size *.pad_to_length *.pad_to_length_bucket"
        ).split(),
        PERF,
    ),
    f"{C}.model.enable_gradient_checkpointing": "sharding.activation_checkpointing covers the critic too",
    f"{C}.model.tokenizer_path": "the critic reads the policy's tokens",
    f"{C}.ppo_max_token_len_per_gpu": "the critic's micro-batches follow the trainer's",
    f"{C}.optim.clip_grad": "critic.grad_clip",
    **dict.fromkeys(
        (
            "reward_model.n_gpus_per_node reward_model.nnodes reward_model.enable_resource_pool "
            "reward_model.strategy reward_model.model.fsdp_config reward.reward_model"
        ).split(),
        "the reward model runs on a device of the run (rewards[].device)",
    ),
    "reward_model.model.input_tokenizer": "the reward model applies its own tokenizer and chat template",
    "reward_model.rollout": "generative reward models are not available",
}


#: verl's other keys (common.tree_keys reads them): those of its ppo_trainer.yaml (_generated_ppo_trainer.yaml
#: from v0.5) at every release v0.1 to v0.7.0, at b178a3c and at verl-project/verl 1dda039 (2026-08-22,
#: 0.10.0.dev), and _generated_ppo_megatron_trainer.yaml's optimizer keys; regenerate it from them as verl grows.
TREE = """
FSDP: _target_ dtype model_dtype param_offload optimizer_offload grad_offload offload_policy reshard_after_forward
    fsdp_size forward_prefetch forward_only use_orig_params seed full_determinism strategy use_torch_compile
    ulysses_sequence_parallel_size entropy_checkpointing entropy_from_logits_chunk_size
    entropy_from_logits_with_chunking pad_to_length pad_to_length_bucket min_num_params
OPTIM: _target_ optimizer optimizer_impl lr betas weight_decay clip_grad lr_scheduler_type warmup_style
    lr_warmup_steps lr_warmup_steps_ratio min_lr_ratio num_cycles total_training_steps zero_indexed_step
    lr_decay_steps lr_decay_style lr_warmup_init lr_wsd_decay_steps lr_wsd_decay_style min_lr
    use_checkpoint_opt_param_scheduler weight_decay_incr_style exp_avg_dtype exp_avg_sq_dtype main_grads_dtype
    use_layer_wise_distributed_optimizer use_precision_aware_optimizer muon_coefficient_type muon_extra_scale_factor
    muon_fp32_matmul_prec muon_match_adamw_update_rms muon_momentum muon_nesterov muon_num_ns_steps
    muon_scalar_optimizer muon_scale_mode muon_split_qkv muon_tp_mode
MODEL: _target_ path hf_config_path tokenizer_path custom_chat_template trust_remote_code external_lib use_shm
    exclude_modules enable_gradient_checkpointing enable_activation_offload use_remove_padding use_fused_kernels
    use_liger lora_rank lora_alpha target_modules lora_adapter_path lora.type lora.rank lora.alpha lora.dropout
    lora.dropout_position lora.dtype lora.target_modules lora.exclude_modules lora.adapter_path lora.merge
    lora.a2a_experimental lora.freeze_language_model lora.freeze_vision_model lora.freeze_vision_projection
    lora.lora_A_init_method lora.lora_B_init_method
PASSES: _target_ strategy rollout_n load_weight use_torch_compile ulysses_sequence_parallel_size
    entropy_checkpointing entropy_from_logits_chunk_size entropy_from_logits_with_chunking pad_to_length
    log_prob_micro_batch_size log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz
    log_prob_max_token_len_per_gpu
actor_rollout_ref: hybrid_engine
actor_rollout_ref.actor: PASSES shuffle data_loader_seed tau_pos tau_neg calculate_entropy calculate_sum_pi_squared
    sum_pi_squared_checkpointing use_prefix_grouper use_fused_kernels use_remove_padding freeze_vision_tower
    policy_loss._target_ policy_loss.clip_cov_ratio policy_loss.clip_cov_lb policy_loss.clip_cov_ub
    policy_loss.kl_cov_ratio policy_loss.ppo_kl_coef policy_loss.dro_beta
actor_rollout_ref.actor.optim: OPTIM
actor_rollout_ref.actor.fsdp_config: FSDP
actor_rollout_ref.ref: PASSES model
actor_rollout_ref.ref.fsdp_config: FSDP
actor_rollout_ref.model: MODEL
actor_rollout_ref.rollout: _target_ mode use_fire_sampling prompt_length seed full_determinism free_cache_engine
    enforce_eager cudagraph_capture_sizes data_parallel_size expert_parallel_size pipeline_model_parallel_size
    n_gpus_per_node nnodes max_num_batched_tokens max_model_len max_num_seqs enable_chunked_prefill
    enable_prefix_caching scheduling_policy logprobs_mode load_format layered_summon multi_stage_wake_up
    calculate_log_probs disable_log_stats skip_rollout skip_dump_dir skip_tokenizer_init quantization_config_file
    moe_load_balance_metrics_interval chat_scheduler update_weights_bucket_megabytes log_prob_micro_batch_size
    log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz log_prob_max_token_len_per_gpu val_kwargs._target_
    val_kwargs.do_sample val_kwargs.n val_kwargs.temperature val_kwargs.top_k val_kwargs.top_p
actor_rollout_ref.rollout.multi_turn: _target_ format max_turns max_assistant_turns max_user_turns
    max_parallel_calls max_tool_response_length tool_response_truncate_side tool_config_path function_tool_path
    interaction_config_path completion_callback use_inference_chat_template tokenization_sanity_check_mode
    num_repeat_rollouts
critic: _target_ enable strategy rollout_n nccl_timeout load_weight use_dynamic_bsz ppo_max_token_len_per_gpu
    forward_micro_batch_size forward_micro_batch_size_per_gpu forward_max_token_len_per_gpu shuffle data_loader_seed
    loss_scale_factor
critic.optim: OPTIM
critic.model: MODEL
critic.fsdp: FSDP
critic.model.fsdp_config: FSDP
data: use_shm val_max_samples image_key video_key audio_key val_batch_size validation_shuffle
    filter_overlong_prompts_workers dataloader_num_workers image_patch_size trust_remote_code tool_config_path
    function_tool_path return_raw_input_ids return_raw_chat return_full_prompt return_multi_modal_inputs
    custom_cls.name datagen.name sampler.class_name
algorithm: _target_ rollout_is rollout_is_level rollout_is_mode rollout_is_threshold rollout_is_threshold_lower
    rollout_is_veto_threshold kl_ctrl._target_ pf_ppo._target_ pf_ppo.reweight_method pf_ppo.weight_pow
    filter_groups._target_ filter_groups.max_inflight_gen_batches
algorithm.rollout_correction: rollout_token_veto_threshold use_policy_gradient
reward_model: nccl_timeout load_weight enable_resource_pool n_gpus_per_node nnodes strategy micro_batch_size
    use_dynamic_bsz forward_max_token_len_per_gpu launch_reward_fn_async ulysses_sequence_parallel_size
    use_reward_loop num_workers reward_loop_source reward_loop_module_path reward_loop_class_name
    model.input_tokenizer model.external_lib model.use_shm model.use_remove_padding model.use_fused_kernels
    overlong_buffer.log
reward_model.model.fsdp_config: FSDP
reward: _target_ num_workers reward_manager._target_ reward_manager.source reward_manager.module._target_
    reward_manager.module.path reward_manager.module.name reward_model._target_ reward_model.enable_resource_pool
    reward_model.n_gpus_per_node reward_model.nnodes
reward_manager: _target_ name source module._target_ module.name
sandbox_fusion: url max_concurrent memory_limit_mb
trainer: val_generations_to_log_to_wandb validation_data_dir balance_batch default_hdfs_dir
    del_local_ckpt_after_load remove_previous_ckpt_in_save max_critic_ckpt_to_keep esi_redundant_time
    ray_wait_register_center_timeout use_legacy_worker_impl use_v1 profile_steps
"""

#: free-form mappings, and machinery left out whole: any key under these passes the check
OPEN = tuple(
    (
        "*.engine_kwargs *.override_config *.reward_kwargs *.override_optimizer_config *.profiler *.tool_config "
        "*.megatron *.turbo_config *.qat *.mtp *.checkpoint *.router_replay *.trace *.prometheus *.disaggregation "
        "*.checkpoint_engine *.fused_kernel_options *.tiled_mlp *.wrap_policy *.sandbox_fusion *.layer_name_map "
        f"{R}.agent {R}.multi_turn reward_model.rollout reward.reward_model.rollout data.apply_chat_template_kwargs "
        "data.mm_processor_kwargs global_profiler trainer.npu_profile trainer.controller_nsight_options "
        "trainer.worker_nsight_options trainer.v1 ray_kwargs ray_init transfer_queue skip distillation"
    ).split()
)


#: every key verl has: a key outside these (and outside :data:`OPEN`) is a typo, which verl refuses too
KNOWN = tree_keys(TREE) | set(DEFAULTS) | set(LOST) | set(MOVED)
