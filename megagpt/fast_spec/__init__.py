"""Training speed without Transformer Engine; see docs/speed.md.

Entry points used by the entry (pretrain_gpt.py / gpt_builders.py):
- settings.add_fast_path_arguments(parser); plan.plan_fast_path(args, installed) /
  plan.apply_plan(plan, args, environ, log) (parse time); settings.install_fast_path_patches
  (args, log) (launch)
- spec.get_fast_gpt_layer_spec(args) / spec.fast_spec_unsupported_reason(args)
- lm_loss.get_output_processor(args): ``model(..., output_processor=...)`` in forward_step
"""
