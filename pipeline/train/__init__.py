"""The train stage: ``launch`` (the rule's entry: submit and wait) and ``worker`` (one rank).

``launch`` is the CLI (:mod:`pipeline.train.launch`, torch-free) over
:mod:`pipeline.train.submit` (submission, reattach, waiting; local or Slurm) and
:mod:`pipeline.train.node` (the in-job supervisor of one node's torchrun). Its settings are
:class:`pipeline.cluster.options.LaunchOptions`, its Slurm submission :mod:`pipeline.cluster.sbatch`'s.
"""
