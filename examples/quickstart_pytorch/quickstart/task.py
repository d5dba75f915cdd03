"""quickstart: a Flower / PyTorch app (Flower's quickstart-pytorch, its CIFAR-10 download replaced by generated
32x32 images, since the internet is not reachable here)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

NUM_CLASSES = 10
NUM_IMAGES = 1200  # CIFAR-10 has 60000; a few hundred per hospital keep the tests quick
TEST_SEED = 1


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
    """32x32 RGB images of 10 classes made from a seed, in CIFAR-10's shape: each class is a grating of its own
    orientation and colour, at a random phase, under noise. Items are dicts, as Flower Datasets gives them."""

    def __init__(self, num_images: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, NUM_CLASSES, (num_images,), generator=generator).tolist()
        self.classes = [f"class-{k}" for k in range(NUM_CLASSES)]
        labels = torch.tensor(self.targets)
        angle = labels.float() * torch.pi / NUM_CLASSES
        colour = torch.rand(NUM_CLASSES, 3, generator=torch.Generator().manual_seed(0))[labels]
        phase = torch.rand(num_images, generator=generator) * 2 * torch.pi
        y, x = torch.meshgrid(torch.linspace(0, 1, 32), torch.linspace(0, 1, 32), indexing="ij")
        along = x[None] * torch.cos(angle)[:, None, None] + y[None] * torch.sin(angle)[:, None, None]
        grating = torch.sin(2 * torch.pi * 4 * along + phase[:, None, None])
        images = 0.5 + 0.4 * grating[:, None] * colour[:, :, None, None]
        images = images + 0.1 * torch.randn(images.shape, generator=generator)
        self.images = ((images.clamp(0, 1) - 0.5) / 0.5).float()  # Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return {"img": self.images[index], "label": self.targets[index]}


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition of the generated images."""
    images = GeneratedImages(NUM_IMAGES, seed=0)
    partition = list(range(partition_id, len(images), num_partitions))  # IID, as IidPartitioner
    # Divide data on each node: 80% train, 20% test
    cut = int(0.8 * len(partition))
    trainloader = DataLoader(Subset(images, partition[:cut]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(Subset(images, partition[cut:]), batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader."""
    return DataLoader(GeneratedImages(NUM_IMAGES // 4, seed=TEST_SEED), batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
