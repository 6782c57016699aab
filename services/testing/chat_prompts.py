"""A fixed set of 32 short chat prompts: what precision choices are judged on (greedy
answers of a lower precision against float32's) and what benchmarks/vs_llamacpp.py
sends. Changing it changes the measured agreement rates quoted in docs/design.md."""

from __future__ import annotations

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "Give me three tips for learning to cook.",
    "Explain photosynthesis in one paragraph.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'good morning' into Spanish and German.",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "What are prime numbers?",
    "Summarise the plot of Romeo and Juliet.",
    "Name five animals that live in the Arctic.",
    "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.",
    "How does a bicycle stay upright?",
    "Suggest a name for a small bakery.",
    "What is gravity?",
    "Write a limerick about a frog.",
    "How many days are there in a leap year, and why?",
    "Give me a recipe for pancakes.",
    "What is the tallest mountain in the world?",
    "Explain what a computer program is to a child.",
    "Why do leaves change colour in autumn?",
    "List three benefits of regular exercise.",
    "What is the boiling point of water at sea level?",
    "Tell me a fun fact about octopuses.",
    "How do airplanes fly?",
    "What should I pack for a weekend camping trip?",
    "Write a two-sentence horror story.",
    "What is the Pythagorean theorem?",
    "How can I improve my handwriting?",
    "What does a doctor do?",
)
