"""The configuration: what each field is, its checks, a run's plan, saved runs read back.

  fields        the field table: each field's role (shape, architecture, recipe, rows,
                draw, runtime) and the value an older saved run gets; every list of
                fields elsewhere is derived from it
  checks        the whole config checked before anything expensive (validate)
  train_checks  the allowed values and checks of config.train, eval and profile
  phases        a run in phases, and the plan of every step (phase, batch, rows, rate)
  run_plan      resolve: the command's config, checked and planned, as a frozen RunPlan
  saved         a run's config.json read back

The command resolves once and hands the RunPlan down; nothing below patches it.
configs/ (the experiments) imports this package; this package imports nothing
of configs/ nor of training/.
"""
