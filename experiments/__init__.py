"""Experiments shipped with pipemare: models, datasets, configs' building blocks, studies.

The modules here are written as for one device; pipemare pipelines their ``nn.Sequential``.
"""

from pipemare.experiments.studies.summary import RunSummary
from pipemare.experiments.tasks.classifiers import DigitsCNN, ImageClassifier
from pipemare.experiments.tasks.datamodules import (
    CharCorpusDataModule,
    CIFAR10DataModule,
    DigitsDataModule,
    IWSLT14DataModule,
    MNISTDataModule,
)
from pipemare.experiments.tasks.gpt import CharGPT
from pipemare.experiments.tasks.language_models import CharTransformerLM
from pipemare.experiments.tasks.lr_schedules import InverseSqrt, WarmupConstant, WarmupCosine
from pipemare.experiments.tasks.translation import TranslationTransformer

__all__ = [
    "CIFAR10DataModule",
    "CharCorpusDataModule",
    "CharGPT",
    "CharTransformerLM",
    "DigitsCNN",
    "DigitsDataModule",
    "IWSLT14DataModule",
    "ImageClassifier",
    "InverseSqrt",
    "MNISTDataModule",
    "RunSummary",
    "TranslationTransformer",
    "WarmupConstant",
    "WarmupCosine",
]
