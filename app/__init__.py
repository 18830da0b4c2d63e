"""The Gradio app: query by image, compare the trained and a refined metric side by side."""
import os

# Gradio reads this when first imported (by app.controls, app.handlers or app.ui): no analytics
# calls unless the user asked for them (the app needs no internet)
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
