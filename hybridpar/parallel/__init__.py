"""The parallel strategies, applied from outside a plain model: ``parallelize`` (pipeline split ->
tensor parallel -> data parallel, in that order), ``mesh`` (the layout's process groups),
``tensor_parallel/`` (plan styles, vocab-parallel layers, autograd collectives), ``pipeline/``
(schedules as data, the simulator, the runtime, boundary inference), ``data_parallel``
(bucketed all-reduce, ZeRO-1), ``batchnorm`` (dp-synchronised BatchNorm), ``collectives``,
``amp`` (loss scaling) and ``memory`` (activation accounting)."""
