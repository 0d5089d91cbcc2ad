"""The API of train_gpt that ../shared/head92_cpu's checks were written against, where this file has moved on since,
expressed in today's: imported before the checks run (tests/test_record92.py), it changes nothing they compare.

The loss seam: the head hands statistics (VocabularyStatistics) and GPT.forward builds the loss from them. The
checks call CrossEntropy(logits, targets, weights, columns) for training's loss and a head called with each token's
next target for validation's, each here the loss GPT.forward builds from the statistics."""
import train_gpt


class CrossEntropy(train_gpt.nn.Module):
    def forward(self, logits, targets, weights=None, columns=None):
        stats = train_gpt.VocabularyStatistics()(logits, targets if targets.dim() == 2 else targets[:, None], columns)
        return train_gpt.summed_loss(stats.log_probs(), stats.found, weights)


class LMHead(train_gpt.LMHead):
    def forward(self, x, targets, previous=None):
        stats = super().forward(x, targets[:, None], previous=previous)
        return train_gpt.summed_loss(stats.log_probs(), stats.found)


train_gpt.CrossEntropy, train_gpt.LMHead = CrossEntropy, LMHead
