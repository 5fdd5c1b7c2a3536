"""Training: losses from the model's own forward pieces, router statistics and the auxiliary-loss-free bias
update, and the jitted train / eval steps.

  * `glm53.train.routing`: `instrument_routers`, `record_routing`, `expert_load`, `bias_update`,
                           `sequence_balance_loss`;
  * `glm53.train.loss`:    `LossConfig`, `token_nll`, `next_token_loss`, `mtp_loss`, `losses`;
  * `glm53.train.step`:    `OptimConfig`, `TrainState`, `split_model`, `init_state`, `make_train_step`,
                           `make_eval_step`;
  * `glm53.train.per_layer`: per-layer names of a scanned model's values (`expand_names`, `expand_state`).
"""
