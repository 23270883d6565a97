"""Draws the example media in assets/examples (committed; rerun to regenerate): shapes, a sign, a short video."""

import os

import cv2
import numpy as np
from PIL import Image, ImageDraw, ImageFont

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "examples")


def shapes(circle_x: int) -> Image.Image:
    image = Image.new("RGB", (1344, 1344), (245, 243, 236))
    draw = ImageDraw.Draw(image)
    draw.rectangle((160, 200, 560, 600), fill=(214, 48, 49))
    draw.ellipse((circle_x, 700, circle_x + 420, 1120), fill=(9, 132, 227))
    draw.polygon([(950, 180), (1200, 620), (700, 620)], fill=(0, 184, 148))
    return image


def sign() -> Image.Image:
    image = Image.new("RGB", (1920, 1080), (40, 44, 52))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((360, 240, 1560, 840), radius=40, fill=(253, 203, 110))
    font = ImageFont.load_default(size=150)
    draw.text((960, 440), "OPEN", fill=(30, 30, 30), font=font, anchor="mm")
    draw.text((960, 640), "9:00 - 17:00", fill=(30, 30, 30), font=ImageFont.load_default(size=90), anchor="mm")
    return image


def ball_video(path: str, seconds: int = 6, fps: int = 24) -> None:
    """A blue ball that rolls from the middle to the right, across to the left and back: its first frame, which
    the chat's example shows cut square from the middle (assets/style.css), shows the ball."""
    width, height, radius = 480, 270, 40
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"VP80"), fps, (width, height))
    for index in range(seconds * fps):
        frame = np.full((height, width, 3), (236, 243, 245), np.uint8)
        x = int(width / 2 + (width / 2 - radius - 10) * np.sin(2 * np.pi * index / (seconds * fps)))
        cv2.circle(frame, (x, height // 2), radius, (227, 132, 9), -1)  # BGR: blue ball
        writer.write(frame)
    writer.release()


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    shapes(180).save(os.path.join(OUT, "shapes.jpg"), quality=88)
    shapes(760).save(os.path.join(OUT, "shapes-moved.jpg"), quality=88)
    sign().save(os.path.join(OUT, "sign.jpg"), quality=88)
    ball_video(os.path.join(OUT, "ball.webm"))
