"""The convnet of pytorch/examples mnist. It knows nothing of devices or distribution: modes are
applied to it from outside (mnist_dist.parallel.wrap_model)."""

from torch import Tensor, nn


class ConvNet(nn.Module):
    """conv 1→32, conv 32→64, maxpool, dropout .25, fc 9216→128, dropout .5, fc 128→10; returns logits.

    ``dropout=False`` removes both dropout layers' effect, so that replicas that draw their own masks
    (DataParallel, one process per rank) compute exactly what a single process would.
    """

    def __init__(self, dropout: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25 if dropout else 0.0),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(9216, 128), nn.ReLU(),
            nn.Dropout(0.5 if dropout else 0.0),
            nn.Linear(128, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
