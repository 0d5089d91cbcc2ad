"""The API of train_gpt that ../shared/head92_cpu's checks were written against, where this file has moved on since,
expressed in today's: imported before the checks run (tests/test_record92.py), it changes nothing they compare.

- The loss seam: the head hands statistics (VocabularyStatistics) and GPT.forward builds the loss from them. The
  checks call CrossEntropy(logits, targets, weights, columns) for training's loss and a head called with each
  token's next target for validation's: each here the loss GPT.forward builds from the statistics.
- The n-gram table's names: the checks call it the bigram table (--bigram_rows, BigramHashEmbedding, a layer's
  `bigram`, its share "bigram"), today's --ngram_rows, NgramHashEmbedding, `ngram` and "ngram".
- Record names as keys: the checks read Adam's settings as ADAM_RECIPES[--optimizer_recipe] and give Muon its step
  size as shape_rule=--optimizer_recipe; today's OPTIMIZER_RECIPES holds both, by the same flag. A layer's `bigram`
  was where the table joins it ("input", "output" or None), today's ModelConfig.ngram_join."""
import dataclasses

import train_gpt


class CrossEntropy(train_gpt.nn.Module):
    def forward(self, logits, targets, weights=None, columns=None):
        stats = train_gpt.VocabularyStatistics()(logits, targets if targets.dim() == 2 else targets[:, None], columns)
        return train_gpt.summed_loss(stats.log_probs(), stats.found, weights)


class LMHead(train_gpt.LMHead):
    def forward(self, x, targets, previous=None):
        stats = super().forward(x, targets[:, None], previous=previous)
        return train_gpt.summed_loss(stats.log_probs(), stats.found)


parse_args, gate_network = train_gpt.parse_args, train_gpt.GateNetwork.forward


def parse_args_by_old_names(argv=None, cuda=None):
    return parse_args([train_gpt.RENAMED_FLAGS.get(flag, flag) for flag in argv], cuda)


def coefficients_by_old_names(self, *args, **kwargs):
    served = gate_network(self, *args, **kwargs)
    return {layer: {**coefficients, **({"bigram": coefficients["ngram"]} if "ngram" in coefficients else {})}
            for layer, coefficients in served.items()}


class MuonByShapeRule(train_gpt.Muon):
    def __init__(self, *args, shape_rule=None, **kwargs):
        super().__init__(*args, **kwargs, **({} if shape_rule is None else dict(
            step_scale=train_gpt.OPTIMIZER_RECIPES[shape_rule][1])))


@dataclasses.dataclass(frozen=True)
class LayerByOldNames(train_gpt.LayerConfig):
    bigram: str | None = None


model_config = train_gpt.model_config


def model_config_by_old_names(args):
    config = model_config(args)
    return dataclasses.replace(config, layers=tuple(LayerByOldNames(**{f.name: getattr(row, f.name) for f in
                                                                       dataclasses.fields(row)},
                                                                    bigram=config.ngram_join(i))
                                                    for i, row in enumerate(config.layers)))


train_gpt.CrossEntropy, train_gpt.LMHead, train_gpt.BigramHashEmbedding = CrossEntropy, LMHead, \
    train_gpt.NgramHashEmbedding
train_gpt.parse_args, train_gpt.GateNetwork.forward = parse_args_by_old_names, coefficients_by_old_names
train_gpt.ADAM_RECIPES = {name: adam for name, (adam, _) in train_gpt.OPTIMIZER_RECIPES.items()}
train_gpt.Muon, train_gpt.model_config = MuonByShapeRule, model_config_by_old_names
