"""monaiexample: Flower's quickstart-monai task (DenseNet121, its train and test), MedNIST replaced by generated 64x64
grey images of its 6 classes (AbdomenCT, BreastMRI, CXR, ChestCT, Hand, HeadCT), handed out as Flower Datasets does."""

import torch
from monai.data import DataLoader
from monai.networks.nets import DenseNet121
from torch.utils.data import Dataset, Subset

NUM_CLASSES = 6
IMAGES_PER_PARTITION = 30  # MedNIST has 58954 images


def load_model():
    """Load a DenseNet12."""
    return DenseNet121(spatial_dims=2, in_channels=1, out_channels=NUM_CLASSES)


class GeneratedMedNIST(Dataset):
    """1x64x64 images in [0, 1] (ScaleIntensity), each class a blob of its own size and place under noise."""

    def __init__(self, num_images: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, NUM_CLASSES, (num_images,), generator=generator).tolist()
        y, x = torch.meshgrid(torch.linspace(-1, 1, 64), torch.linspace(-1, 1, 64), indexing="ij")
        labels = torch.tensor(self.targets, dtype=torch.float32)[:, None, None]
        centre = (labels - 2.5) / 4
        blob = torch.exp(-((x - centre) ** 2 + y ** 2) / (0.05 + 0.03 * labels))
        images = blob + 0.2 * torch.rand(num_images, 64, 64, generator=generator)
        self.images = (images / images.amax(dim=(1, 2), keepdim=True))[:, None].float()

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return {"img": self.images[index], "label": self.targets[index]}


def load_data(num_partitions, partition_id, batch_size):
    """An IID partition of the generated images, split 80/20 into train and validation loaders."""
    images = GeneratedMedNIST(IMAGES_PER_PARTITION * num_partitions, seed=0)
    partition = list(range(partition_id, len(images), num_partitions))
    cut = int(0.8 * len(partition))
    train_loader = DataLoader(Subset(images, partition[:cut]), batch_size=batch_size, shuffle=True)
    val_loader = DataLoader(Subset(images, partition[cut:]), batch_size=batch_size)
    return train_loader, val_loader


def train_func(model, train_loader, epoch_num, device):
    model.to(device)
    loss_function = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), 1e-5)
    epoch_loss = 0.0
    for _ in range(epoch_num):
        model.train()
        for batch in train_loader:
            images, labels = batch["img"].to(device), batch["label"].to(device)
            optimizer.zero_grad()
            loss = loss_function(model(images), labels)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item()
    return epoch_loss / len(train_loader)


def test_func(model, test_loader, device):
    model.to(device)
    model.eval()
    loss = 0.0
    correct = 0
    loss_function = torch.nn.CrossEntropyLoss()
    with torch.no_grad():
        for batch in test_loader:
            images, labels = batch["img"].to(device), batch["label"].to(device)
            out = model(images)
            loss += loss_function(out, labels).item()
            correct += (out.argmax(dim=1) == labels).sum().item()
    return loss, correct / len(test_loader.dataset)
