"""The digits data set (8x8 handwritten digits, shipped with python3-sklearn) and a small CNN.

Shared by the examples: nothing is downloaded at run time. The split is fixed (seeded) so every
node and every run sees the same train and test sets.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def load_digits_datasets(test_fraction=0.2, seed=0):
    """(train, test) TensorDatasets of (image[1,8,8] float32 in [0,1], label int64)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = np.random.RandomState(seed).permutation(len(labels))
    n_test = int(len(labels) * test_fraction)
    test_idx, train_idx = order[:n_test], order[n_test:]
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))


class DigitsCNN(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


@torch.no_grad()
def accuracy(model, dataset, batch_size=512):
    model.eval()
    correct = 0
    for i in range(0, len(dataset), batch_size):
        x, y = dataset[i:i + batch_size]
        correct += (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(dataset)
