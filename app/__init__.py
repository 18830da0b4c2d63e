"""The Gradio app: query by image, compare the trained and a refined metric side by side."""
