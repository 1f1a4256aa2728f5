"""Experiments shipped with pipemare: models, datasets, configs' building blocks, studies.

The modules here are written as for one device; pipemare pipelines their ``nn.Sequential``.
"""

from pipemare.experiments.classifiers import DigitsCNN, ImageClassifier
from pipemare.experiments.datamodules import (
    CharCorpusDataModule,
    CIFAR10DataModule,
    DigitsDataModule,
    IWSLT14DataModule,
    MNISTDataModule,
)
from pipemare.experiments.language_models import CharTransformerLM
from pipemare.experiments.lr_schedules import InverseSqrt, WarmupConstant, WarmupCosine
from pipemare.experiments.summary import RunSummary
from pipemare.experiments.translation import TranslationTransformer

__all__ = [
    "CIFAR10DataModule",
    "CharCorpusDataModule",
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
