"""Instruction prompts for target-generated distillation data, and held-out evaluation prompts.

Owns: deterministic prompt lists built from templates × subjects (train) and a disjoint, hand-written
held-out set (code, chat, math-like) that never appears in training. Pure Python, no model code.
"""
from __future__ import annotations

import random

_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "merges two sorted lists", "counts the words in a text", "finds the largest element in a list",
    "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
    "reads a CSV file and prints each row", "computes the n-th Fibonacci number",
    "checks whether a string is a palindrome", "flattens a nested list", "sorts a dictionary by value",
    "returns the GCD of two integers", "validates an email address with a regular expression",
    "implements binary search", "computes the mean and median of a list", "transposes a matrix",
    "parses a JSON string and returns a key", "generates all permutations of a list",
    "implements a simple stack class", "implements a queue with two stacks", "counts vowels in a string",
    "finds the intersection of two sets", "computes the sum of digits of a number",
    "downloads nothing but formats a date as YYYY-MM-DD", "chunks a list into pieces of size k",
    "implements bubble sort", "implements quicksort", "checks if two strings are anagrams",
    "capitalizes every word in a sentence", "computes the power set of a set", "converts binary to decimal",
    "writes a list of lines to a file", "finds the most common element in a list",
    "implements a linked list with insert and delete", "computes a running average",
    "reverses the words in a sentence", "checks balanced parentheses", "computes compound interest",
]
_LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go", "Bash", "SQL"]
_CODE_TEMPLATES = [
    "Write a {lang} function that {task}.", "How do I write a {lang} program that {task}?",
    "Show me {lang} code that {task}, with a short explanation.",
    "Write a function in {lang} that {task}. Add comments.",
]
_SUBJECTS = [
    "photosynthesis", "the water cycle", "gravity", "black holes", "the French Revolution", "democracy",
    "inflation", "supply and demand", "machine learning", "neural networks", "the internet", "DNA",
    "vaccines", "climate change", "renewable energy", "the Roman Empire", "volcanoes", "earthquakes",
    "the immune system", "sleep", "meditation", "healthy eating", "exercise", "time management",
    "public speaking", "writing a resume", "job interviews", "saving money", "investing", "budgeting",
    "learning a new language", "playing the guitar", "gardening", "cooking pasta", "baking bread",
    "coffee", "tea", "chess", "football", "the Olympic Games", "the solar system", "the moon", "Mars",
    "electric cars", "batteries", "solar panels", "recycling", "plastic pollution", "the ocean",
    "rainforests", "deserts", "bees", "dogs", "cats", "birds migration", "dinosaurs", "evolution",
    "the human brain", "memory", "stress", "friendship", "leadership", "teamwork", "creativity",
    "critical thinking", "the printing press", "electricity", "magnets", "light", "sound", "atoms",
    "chemical reactions", "the periodic table", "fractions", "prime numbers", "probability",
    "statistics", "geometry", "algebra", "calculus", "computer memory", "operating systems",
    "databases", "cloud computing", "cybersecurity", "passwords", "encryption", "open source software",
    "version control with git", "the Linux command line", "smartphones", "social media", "journalism",
    "libraries", "museums", "poetry", "novels", "music theory", "painting", "photography", "movies",
    "travel planning", "camping", "mountains", "rivers", "weather forecasting", "clouds", "snow",
]
_CHAT_TEMPLATES = [
    "Explain {s} in simple terms.", "What is {s}?", "Give me three interesting facts about {s}.",
    "Write a short paragraph about {s}.", "Why is {s} important?", "How does {s} work?",
    "Write a short poem about {s}.", "What are the pros and cons of {s}?",
    "Give me five tips about {s}.", "Explain {s} to a ten-year-old.",
    "Summarize the key ideas of {s} in a few sentences.", "What are common misconceptions about {s}?",
    "Write a short story that involves {s}.", "List some questions a student might ask about {s}.",
    "Compare {s} with something similar and explain the differences.",
]
_MATH_TEMPLATES = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "If I have {a} apples and give away {b}, how many are left?",
    "A train travels {a} km in {b} hours. What is its average speed?", "Solve for x: {a}x + {b} = {c}.",
    "What is {a} percent of {c}?", "Is {c} divisible by {b}? Explain.", "Compute the area of a rectangle {a} by {b}.",
    "A shop sells pens at {b} dollars each. How much do {a} pens cost?", "What is the square of {a}?",
]

HELD_OUT_PROMPTS: list[tuple[str, str]] = [
    ("code", "Write a Python function that returns the k most frequent words in a text file."),
    ("code", "Write a Python class for a bank account with deposit, withdraw and balance methods."),
    ("code", "Explain what this Python code does: [x * x for x in range(10) if x % 2 == 0]"),
    ("code", "Write a JavaScript function that debounces another function."),
    ("code", "How do I read a text file line by line in Python and skip empty lines?"),
    ("code", "Write a SQL query that returns the ten customers with the highest total order value."),
    ("chat", "What should I pack for a weekend hiking trip in the Alps?"),
    ("chat", "Explain how a refrigerator keeps food cold."),
    ("chat", "Write a friendly email inviting my neighbours to a summer barbecue."),
    ("chat", "What are the main differences between a violin and a cello?"),
    ("chat", "Give me advice on how to start running as a complete beginner."),
    ("chat", "Describe the life cycle of a butterfly."),
    ("math", "Tom has 17 marbles and buys 3 bags of 12 marbles each. How many marbles does he have now?"),
    ("math", "What is 15% of 240? Show your steps."),
    ("math", "A rectangle has a perimeter of 36 cm and a width of 7 cm. What is its length?"),
    ("math", "Solve the equation 3x - 7 = 2x + 5."),
    ("math", "If a car uses 6 litres of fuel per 100 km, how much fuel does it need for 350 km?"),
    ("math", "What is the sum of the first 20 positive integers? Explain the formula."),
]


def training_prompts(seed: int = 0, n: int | None = None) -> list[str]:
    """Deterministic, shuffled list of training prompts (code, chat, math-like)."""
    rng = random.Random(seed)
    out: list[str] = []
    for task in _CODE_TASKS:
        for t in _CODE_TEMPLATES:
            out.append(t.format(lang=rng.choice(_LANGS), task=task))
    for s in _SUBJECTS:
        for t in rng.sample(_CHAT_TEMPLATES, 9):
            out.append(t.format(s=s))
    for _ in range(300):
        a, b = rng.randint(2, 99), rng.randint(2, 50)
        out.append(rng.choice(_MATH_TEMPLATES).format(a=a, b=b, c=rng.randint(10, 500)))
    held = {p for _, p in HELD_OUT_PROMPTS}
    out = sorted({p for p in out if p not in held})
    rng.shuffle(out)
    return out[:n] if n else out
