"""custom_mods: Flower's task (the tutorial CNN, its train and test), CIFAR-10 replaced by generated 32x32 images."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class GeneratedImages(Dataset):
    """In CIFAR-10's shape: 10 classes, each a colour of its own under noise; dict items, as Flower Datasets."""

    def __init__(self, num_images: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 10, (num_images,), generator=generator).tolist()
        colour = torch.rand(10, 3, 1, 1, generator=torch.Generator().manual_seed(0))[torch.tensor(self.targets)]
        self.images = (colour + 0.3 * torch.randn(num_images, 3, 32, 32, generator=generator) - 0.5) / 0.5

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return {"img": self.images[index], "label": self.targets[index]}


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition of the generated images: 80% train, 20% test."""
    images = GeneratedImages(400, seed=0)
    partition = list(range(partition_id, len(images), num_partitions))
    cut = int(0.8 * len(partition))
    trainloader = DataLoader(Subset(images, partition[:cut]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(Subset(images, partition[cut:]), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(batch["img"].to(device)), batch["label"].to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / len(trainloader)


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            outputs = net(batch["img"].to(device))
            labels = batch["label"].to(device)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
