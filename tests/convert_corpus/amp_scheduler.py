"""Train a small CNN classifier with mixed precision, a one-cycle LR schedule, tqdm and TensorBoard.

The images are synthetic (a per-class colour and stripe pattern plus noise), generated here, so
nothing is downloaded.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--no-amp", action="store_true", help="disable autocast")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=str, default="runs/amp_scheduler")
    parser.add_argument("--checkpoint", type=str, default="checkpoint.pth")
    return parser.parse_args()


def make_dataset(n, num_classes, seed):
    # the class patterns are shared by both splits; the labels and the noise are per split
    colours = torch.rand(num_classes, 3, 1, 1, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    stripes = torch.linspace(-1, 1, 16).view(1, 1, 16).expand(3, 16, 16)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    freq = (labels.float() + 1).view(n, 1, 1, 1)
    images = colours[labels] + 0.3 * torch.sin(freq * stripes) + 0.4 * torch.randn(n, 3, 16, 16, generator=g)
    return TensorDataset(images, labels)


class SmallCNN(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.features(x)
        return self.classifier(torch.flatten(x, 1))


def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, epoch, writer, use_amp, amp_dtype):
    model.train()
    running_loss = 0.0
    pbar = tqdm(loader, desc=f"Epoch {epoch} [train]")
    for step, (images, labels) in enumerate(pbar):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=use_amp):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)

        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()  # OneCycleLR steps every batch

        running_loss += loss.item()
        global_step = epoch * len(loader) + step
        writer.add_scalar("train/loss", loss.item(), global_step)
        writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)
        pbar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.4f}")

    return running_loss / len(loader)


@torch.no_grad()
def validate(model, loader, device, use_amp, amp_dtype):
    model.eval()
    correct = 0
    total = 0
    val_loss = 0.0
    for x, y in tqdm(loader, desc="[val]", leave=False):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=use_amp):
            logits = model(x)
        val_loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        total += y.size(0)
    return val_loss / total, correct / total


def main():
    args = get_args()
    torch.manual_seed(args.seed)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_amp = not args.no_amp
    # float16 needs the scaler; bfloat16 (the only CPU autocast type) does not
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    train_set = make_dataset(512, args.num_classes, seed=1)
    val_set = make_dataset(256, args.num_classes, seed=2)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              num_workers=0, pin_memory=torch.cuda.is_available())
    val_loader = DataLoader(val_set, batch_size=2 * args.batch_size, shuffle=False, num_workers=0)

    model = SmallCNN(num_classes=args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_loader))
    scaler = torch.amp.GradScaler("cuda", enabled=(use_amp and device.type == "cuda"))

    writer = SummaryWriter(log_dir=args.log_dir)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, scaler, device, epoch,
                                     writer, use_amp, amp_dtype)
        val_loss, val_acc = validate(model, val_loader, device, use_amp, amp_dtype)
        writer.add_scalar("val/loss", val_loss, epoch)
        writer.add_scalar("val/acc", val_acc, epoch)
        print(f"epoch {epoch}: train_loss={train_loss:.4f} val_loss={val_loss:.4f} val_acc={val_acc:.4f}")

        if val_acc >= best_acc:
            best_acc = val_acc
            os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
            torch.save({
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
            }, args.checkpoint)

    writer.close()
    print(f"best val acc: {best_acc:.4f}")


if __name__ == "__main__":
    main()
