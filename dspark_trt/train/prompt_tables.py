"""Prompt tables: the wordings and vocabularies the scaled prompt builders draw from.

Owns: the task-form wordings of the package-code and doc-paragraph prompts, the math problem forms with their
unit pairs and tails, the self-instruct topics, personas and kinds, and the multi-turn follow-up wordings by
prompt kind. Pure data, no logic; `prompt_sources_scale` builds the prompts from them.
"""
from __future__ import annotations

_PKG_FORMS: dict[str, tuple[str, ...]] = {
    "explain": ("Explain what this Python code from `{where}` does:", "What does this function do? Walk me through it:",
                "Explain this Python function in plain English:"),
    "complete": ("Complete this Python function so that it does what its docstring says:",
                 "Implement the body of this function:"),
    "refactor": ("Refactor this Python function for readability and explain your changes:",
                 "How could this code be made cleaner? Show the refactored version:"),
    "tests": ("Write pytest tests for this function:", "Write a few unit tests (pytest) that cover this code:"),
    "hints": ("Add type hints and a docstring to this Python function:",
              "Annotate this function with type hints and write a docstring for it:"),
    "js": ("Translate this Python function into JavaScript:", "Rewrite this code in JavaScript:"),
    "bugfix": ("This Python function has a bug. Find it, explain it, and give the fixed code:",
               "There is a subtle bug in this code. What is it and how do you fix it?"),
}

_DOC_FORMS = (
    "Summarize this passage in one sentence:\n\n\"{p}\"", "List the key points of this text:\n\n{p}",
    "Write a short, descriptive title for this paragraph:\n\n{p}",
    "Read the passage and answer: what is the main idea of this passage?\n\n\"{p}\"",
    "Explain this text to a beginner who has never heard of the topic:\n\n{p}",
    "Write two quiz questions (with answers) about this text:\n\n{p}",
)

_MATH_FORMS = (  # arithmetic, equations, percentages, units, sequences, probability, geometry, speed, fractions, …
    "Calculate {expr}.", "What is {expr}?", "Work out {expr} step by step.", "Solve for x: {lin} = {rhs}",
    "Find x if {lin} = {rhs}.", "Solve the equation {lin} = {lin2}.", "What is {p}% of {v}?",
    "{w} is what percent of {vw}?", "After a {p}% discount, a jacket costs {v} dollars. What was the original price?",
    "A price rises from {w} to {wp} dollars. What is the percentage increase?", "Convert {v} {u1} to {u2}.",
    "How many {u2} are in {w} {u1}?", "What is the next number in {seq}, ...?",
    "Find the pattern and the next term: {seq}, ...",
    "A bag has {a} red and {b} blue marbles. If you pick one at random, what is the probability it is red?",
    "Two fair dice are rolled. What is the probability that their sum is {s}?",
    "A fair coin is flipped {k} times. What is the probability of getting exactly one head?",
    "From a bag of {a} red and {b} green balls, two are drawn without replacement. What is the probability that "
    "both are red?", "What is the probability of drawing a {card} from a standard deck of 52 cards?",
    "What is the area of a triangle with base {a} cm and height {h} cm?",
    "Find the area and circumference of a circle with radius {h} m.",
    "What is the volume of a box that is {a} cm by {b} cm by {h} cm?",
    "A cylinder has radius {a} cm and height {h} cm. What is its volume?",
    "A trapezoid has parallel sides of {a} m and {b} m and a height of {h} m. What is its area?",
    "{nm} cycles at {sp} km/h for {t} hours. How far does {nm} travel?",
    "A car covers {spt} km in {t} hours. What is its average speed?",
    "A train leaves at {clock} and the trip takes {dm} minutes. When does it arrive?",
    "Two cars start {gap} km apart and drive toward each other at {sp} and {sp2} km/h. When do they meet?",
    "What is {a}/{b} + {c}/{d}?", "Compute {a}/{b} - {c}/{d}.", "What is {a}/{b} × {c}/{d}?",
    "Divide {a}/{b} by {c}/{d}.", "Simplify the fraction {ac}/{bc}.", "Which is larger, {a}/{b} or {c}/{d}?",
    "Divide {v} dollars between two people in the ratio {a}:{c}.", "What is {c} to the power of {k}?",
    "Find the greatest common divisor and least common multiple of {ac} and {bc}.",
    "Find the mean, median and mode of {data}.", "What is the square root of {sq}?",
    "{nm} invests {v} dollars at {k}% simple interest per year. How much interest is earned after {t} years?",
    "{nm} buys {a} {item}s at {c} dollars each and sells them for {d} dollars each. What is the profit or loss?",
)
_UNITS = (
    ("kilometres", "miles"), ("miles", "kilometres"), ("kilograms", "pounds"), ("litres", "millilitres"),
    ("hours", "seconds"), ("degrees Celsius", "degrees Fahrenheit"), ("inches", "centimetres"),
    ("square metres", "square centimetres"), ("feet", "metres"), ("gigabytes", "megabytes"), ("days", "minutes"),
    ("ounces", "grams"),
)
_MATH_TAILS = ("", "", " Show your work.", " Explain each step.", " Give the final answer on its own line.")

_TOPICS = tuple((
    "cell division; the speed of light; plate tectonics; the greenhouse effect; antibiotics; enzymes; the "
    "nitrogen cycle; quantum computing; nuclear energy; genetics; the big bang; ocean tides; rainbows; static "
    "electricity; friction; acids and bases; the human heart; bacteria and viruses; coral reefs; the ozone layer;"
    " telescopes; microscopes; fossils; ancient Egypt; the Renaissance; World War I; the Industrial Revolution; "
    "the Cold War; the Silk Road; the Vikings; the invention of writing; the American Revolution; the Ming "
    "dynasty; the fall of the Berlin Wall; the history of medicine; the space race; ancient Greece; the Aztecs; "
    "doing laundry; grocery shopping; cleaning a kitchen; moving to a new city; buying a used car; planning a "
    "birthday party; caring for houseplants; fixing a leaking tap; packing a suitcase; making friends as an "
    "adult; writing a thank-you note; commuting by bike; raising a puppy; Python lists; Python dictionaries; "
    "recursion; unit testing; object-oriented programming; regular expressions; SQL joins; REST APIs; JavaScript "
    "promises; HTML and CSS; Docker containers; sorting algorithms; hash tables; binary trees; graph search; "
    "big-O notation; debugging; exception handling; file input and output; command-line tools; concurrency; "
    "memory leaks; type systems; functional programming; code review; web scraping; data visualization; linear "
    "equations; quadratic equations; percentages; ratios; the Pythagorean theorem; circles; triangles; negative "
    "numbers; exponents; logarithms; matrices; vectors; mean and median; compound interest; permutations; "
    "derivatives; integrals; number bases; writing an essay; writing a cover letter; persuasive writing; grammar;"
    " punctuation; writing dialogue; editing a draft; writing a summary; keeping a journal; writing a speech; "
    "blog posts; storytelling; metaphors; writing emails; note-taking; drinking enough water; back pain; first "
    "aid; healthy snacks; strength training; stretching; screen time; posture; sun protection; the common cold; "
    "allergies; mental health; walking; starting a small business; marketing; customer service; negotiation; "
    "pricing a product; writing a business plan; hiring; remote work; project management; taxes; accounting "
    "basics; e-commerce; branding; startups; sales; meetings; giving feedback; productivity; jazz; classical "
    "music; film making; sculpture; architecture; fashion; video games; mythology; philosophy; ethics; economics;"
    " psychology; sociology; languages of the world; maps and navigation; airplanes; trains; bridges; "
    "skyscrapers; robots; 3D printing; artificial intelligence; spreadsheets; online privacy; email etiquette; "
    "volunteering"
).split("; "))
_PERSONAS = tuple((
    "a high-school student; a curious ten-year-old; a university student; a software engineer; a retired teacher;"
    " a small-business owner; a nurse; a first-time parent; a journalist; a beginner programmer; a farmer; a "
    "tourist; a data scientist; a novelist; a job seeker; an engineering professor"
).split("; "))
_KINDS = (
    "Write one 'how do I' question {p} might ask about {t}.", "Write one 'why' question {p} might ask about {t}.",
    "Write one question {p} might ask that compares {t} with something related.",
    "Write one request {p} might make asking for an explanation of some part of {t}.",
    "Write one small programming task related to {t} that {p} might ask an assistant to solve.",
    "Write one question in which {p} asks for advice about {t}.",
    "Write one creative writing request (a poem, a story or a dialogue) about {t} that {p} might make.",
    "Write one question {p} might ask about what a term related to {t} means.",
    "Write one practical problem about {t} that {p} might want solved step by step.",
    "Write one question about {t} that {p} might ask to check their own understanding.",
)

_FOLLOW_UPS = {
    "code": ("Now add error handling.", "Can you write tests for it?", "Rewrite it in JavaScript.",
             "Explain the code line by line.", "Can you make it more efficient?", "What is its time complexity?"),
    "math": ("Check your answer step by step.", "Can you solve it another way?",
             "Explain the method as if I were a beginner.", "Give me a similar problem to practise."),
    "other": ("Can you make it shorter?", "Give me an example.", "Explain the second point in more detail.",
              "What are the pros and cons?", "Summarize that in one sentence.", "Can you explain it more simply?",
              "What is a common mistake people make here?", "Turn that into a bulleted list."),
}
