"""The model owner's offline step: pretrain the teacher, distill it into its FHE-friendly student.

:mod:`~fedfm.distillation.training` (plain supervised training), :mod:`~fedfm.distillation.distill`
(the two-stage distillation of spec 001 §3.1, App. D.2) and :mod:`~fedfm.distillation.pipeline`
(data, teacher cache, resumable distillation and its report: ``fedfm distill``). Protocols never
import this package: their apps load a student that exists and name the command that makes one.
"""
