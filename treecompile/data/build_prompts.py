"""Writes the prompt sets ``prompts_train.json`` and ``prompts_heldout.json`` beside this script.

Run ``python treecompile/data/build_prompts.py`` after editing the lists below; the JSON files are
committed and ``tests/runtime/test_prompts.py`` checks that they equal this script's output.

Prompts are templates x topics over five categories (chat, code, math, writing, extraction). The
held-out set draws on topics reserved for it (``HELDOUT_*``, never used in training) and a few templates
of its own, so it measures a drafter on prompts it has not been distilled on, not on rephrasings of
them. Fully deterministic: no randomness, no set iteration; numbers come from fixed arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMAT_VERSION = 1

# --- chat: explanations, advice, comparisons -------------------------------------------------------
CHAT_TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "inflation", "vaccines", "plate tectonics",
    "the French Revolution", "machine learning", "compound interest", "climate change", "the human heart",
    "electric cars", "the Roman Empire", "blockchain", "sleep", "the stock market", "renewable energy",
    "the printing press", "DNA", "the Internet", "gravity", "coffee", "the Great Wall of China",
    "recycling", "earthquakes", "the Olympic Games", "honey bees", "solar panels", "the moon landing",
    "antibiotics", "the Renaissance", "rainbows", "supply and demand", "coral reefs", "jazz music",
    "the Industrial Revolution", "nuclear power", "meditation", "tides", "the ancient Egyptians",
    "cloud computing", "hurricanes", "the immune response to a cold", "democracy", "quantum computers",
    "migrating birds", "the Silk Road", "bread baking", "the Amazon rainforest", "3D printing",
    "the speed of light", "chess openings", "public libraries", "composting", "the Cold War",
    "tea ceremonies", "glaciers", "credit scores", "the Moon's phases", "electric guitars",
]
CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are the most important facts about {t}?",
    "Can you give me a short overview of {t}?",
    "Why is {t} important?",
    "Explain {t} to a ten-year-old.",
    "What is a common misconception about {t}?",
    "Tell me three interesting things about {t}.",
    "How would you describe {t} in one paragraph?",
    "What should a beginner know about {t}?",
    "What questions do people often ask about {t}?",
]
ADVICE_ACTIVITIES = [
    "learning a new language", "staying focused while studying", "running a first marathon",
    "saving money on groceries", "preparing for a job interview", "keeping houseplants alive",
    "writing a good resume", "improving my sleep", "starting a vegetable garden", "learning to cook",
    "speaking in public", "organizing a small office", "traveling on a budget", "learning the piano",
    "making new friends in a new city", "reducing screen time", "training a puppy",
    "planning a birthday party", "getting better at chess", "staying healthy while working from home",
]
ADVICE_TEMPLATES = [
    "Give me three tips for {a}.",
    "What is the best way to get started with {a}?",
    "I am struggling with {a}. Any advice?",
]
COMPARISONS = [
    ("cats", "dogs as pets"), ("trains", "planes for a 500 km trip"), ("renting", "buying a home"),
    ("tea", "coffee"), ("e-books", "printed books"), ("running", "swimming for fitness"),
    ("a laptop", "a desktop computer"), ("city life", "country life"), ("email", "instant messaging at work"),
    ("wind power", "solar power"), ("a gas stove", "an induction cooktop"), ("public schools", "homeschooling"),
]

# --- code ---------------------------------------------------------------------------------------
CODE_LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "TypeScript"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the order", "computes the factorial of n",
    "checks whether a string is a palindrome", "finds the largest element of an array",
    "converts Celsius to Fahrenheit", "computes the greatest common divisor of two integers",
    "flattens a nested list", "counts how often each word occurs in a text",
    "performs binary search on a sorted array", "returns the sum of the digits of an integer",
    "rotates a list by k positions", "checks whether two strings are anagrams",
    "computes the average of a list of numbers", "transposes a matrix",
    "finds the second largest number in a list", "validates a simple email address",
    "converts a decimal number to binary", "returns all even numbers from a list",
    "capitalizes the first letter of every word", "computes the running sum of a list",
    "implements bubble sort", "checks whether parentheses in a string are balanced",
    "returns the intersection of two lists", "computes the power set of a small set",
    "converts a Roman numeral to an integer",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "In {lang}, how do I write code that {task}? Show an example.",
    "Write a short {lang} program that {task}, with comments.",
]
CODE_CONCEPTS = [
    ("a list", "a tuple in Python"), ("let", "const in JavaScript"), ("a process", "a thread"),
    ("TCP", "UDP"), ("a stack", "a queue"), ("recursion", "iteration"), ("SQL", "NoSQL databases"),
    ("git merge", "git rebase"), ("an interface", "an abstract class"), ("compiled", "interpreted languages"),
    ("a pointer", "a reference in C++"), ("HTTP GET", "HTTP POST"), ("unit tests", "integration tests"),
    ("a hash map", "a binary search tree"), ("synchronous", "asynchronous code"),
]
CODE_SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(1, 16):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)",
    "const total = items.reduce((acc, item) => acc + item.price * item.qty, 0);",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 5;",
    "int sum = 0;\nfor (int i = 0; i < n; i++) sum += a[i];",
    "def g(n):\n    return n if n < 2 else g(n - 1) + g(n - 2)",
    "words = sorted(set(text.lower().split()))",
    "git log --oneline --graph --all",
    "let v: Vec<i32> = (1..=10).filter(|x| x % 3 == 0).collect();",
    "with open('data.txt') as fh:\n    lines = [line.strip() for line in fh if line.strip()]",
]
SNIPPET_TEMPLATES = [
    "Explain what this code does:\n{code}",
    "Is there anything wrong with this code? How could it be improved?\n{code}",
]
SQL_TASKS = [
    "lists all customers from Canada", "finds the ten most expensive products",
    "counts orders per month in 2023", "finds employees who earn more than their manager",
    "returns the average salary per department", "deletes rows older than one year from a logs table",
]

# --- math ---------------------------------------------------------------------------------------
MATH_CONCEPTS = [
    "a prime number", "the Pythagorean theorem", "a derivative", "probability", "a logarithm",
    "the area of a circle", "a fraction", "standard deviation", "an integral", "a matrix",
    "the order of operations", "a percentage", "a vector", "an exponential function", "a median",
]
SHAPES = [("rectangle", "length {a} cm and width {b} cm", "area"), ("triangle", "base {a} m and height {b} m", "area"),
          ("box", "sides {a}, {b} and {c} cm", "volume"), ("circle", "radius {a} cm", "circumference")]
ITEMS = ["apples", "pencils", "books", "tickets", "cookies", "stamps", "marbles", "notebooks"]
NAMES = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]

# --- writing ------------------------------------------------------------------------------------
WRITING_SUBJECTS = [
    "the ocean at night", "a rainy Monday morning", "an old lighthouse", "autumn leaves", "a city at dawn",
    "a lost umbrella", "friendship", "the first snow of winter", "a busy train station", "a cup of tea",
    "a mountain village", "a robot learning to paint", "the last day of summer", "a library at midnight",
    "a grandmother's kitchen", "a small boat in a storm", "the desert after rain", "a forgotten letter",
    "a street market", "a cat watching birds",
]
WRITING_TEMPLATES = [
    "Write a short poem about {s}.",
    "Write a haiku about {s}.",
    "Write a short story (about 150 words) about {s}.",
    "Describe {s} in vivid detail.",
    "Write the opening paragraph of a novel set around {s}.",
]
EMAILS = [
    ("my landlord", "a broken heating system"), ("my manager", "taking a day off next Friday"),
    ("a customer", "a delayed delivery"), ("a professor", "an extension for an assignment"),
    ("a colleague", "rescheduling our weekly meeting"), ("the city council", "a dangerous crossing near a school"),
    ("a hotel", "a room reservation for three nights"), ("a supplier", "a wrong invoice"),
    ("my team", "a new code review process"), ("a neighbour", "a noisy party"),
]
EMAIL_TEMPLATES = [
    "Write a polite email to {to} about {about}.",
    "Write a short, formal email to {to} regarding {about}.",
]
PRODUCTS = [
    "a reusable water bottle", "noise-cancelling headphones", "a standing desk", "a solar phone charger",
    "an electric kettle", "a hiking backpack", "a smart watch", "a bamboo toothbrush", "a coffee grinder",
    "a children's picture book about space",
]
PRODUCT_TEMPLATES = [
    "Write a product description for {p}.",
    "Write a catchy slogan for {p}.",
    "Write a short customer review of {p}.",
]

# --- extraction ---------------------------------------------------------------------------------
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Dublin", "Hanoi", "Perth", "Tunis"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
COMPANIES = ["Northwind Ltd", "Bluepeak Systems", "Greenleaf Foods", "Orbit Logistics", "Maple Analytics",
             "Redstone Energy", "Silverline Media", "Harbor Robotics"]
REVIEW_ASPECTS = [("battery life", "lasts two full days"), ("screen", "is bright and sharp"),
                  ("delivery", "took three weeks"), ("sound", "is muffled at high volume"),
                  ("customer support", "answered within an hour"), ("price", "feels too high"),
                  ("build quality", "is solid"), ("setup", "was confusing")]
REVIEW_TASKS = [
    "Classify the sentiment of this review as positive, negative or mixed: {r}",
    "List the product aspects mentioned in this review and whether each is praised or criticized: {r}",
]
EXTRACTION_TASKS = [
    "Extract every person's name, city and date from this text and return them as a JSON list:\n{text}",
    "List all the dates mentioned in the following text:\n{text}",
    "Who is mentioned in this text, and where are they? Answer as a bullet list.\n{text}",
    "Summarize the following text in one sentence:\n{text}",
]

# --- the second batch of training prompts (thirty-third session) ----------------------------------------
# Until then every head was distilled from the ~750 prompts above; the data grew by sampling more
# continuations of the same prompts. These add new topics, tasks and phrasings in every category (appended
# after the first batch; the held-out topics stay out, `_check_reserved_topics`).
MORE_CHAT_TOPICS = [
    "the nitrogen cycle", "sharks", "the periodic table", "the Pyramids of Giza", "wind turbines",
    "the Byzantine Empire", "batteries", "the Milky Way", "tsunamis", "the Mongol Empire", "mushrooms",
    "desalination", "the Apollo program", "penguins", "the theory of evolution", "the Big Bang", "dinosaurs",
    "the Suez Canal", "the ozone layer", "magnets", "the Hubble Space Telescope", "artificial sweeteners",
    "the Ottoman Empire", "GPS satellites", "fermentation", "the Panama Canal", "elephants", "carbon capture",
    "microplastics", "the Maya civilization", "hydroelectric dams", "sourdough starters", "the Enlightenment",
    "lightning", "the Wright brothers", "wolves", "the Mariana Trench", "cryptography", "the Black Death",
    "sea turtles", "deserts", "the Hanseatic League", "fossil fuels", "the immune system", "urban gardening",
    "the Eiffel Tower", "public transportation", "vitamins", "the Aztecs", "high-speed rail",
    "mountain formation", "the Viking Age", "autonomous vehicles", "the placebo effect", "the Roman aqueducts",
    "hydrogen fuel", "bats and echolocation", "the Golden Gate Bridge", "the Sahara", "the telescope",
    "the steam engine", "monsoons", "chocolate making", "the Louvre", "the human skeleton", "minimalism",
    "the Marshall Plan", "wildfires", "biodiversity", "the Dead Sea", "opera", "origami", "podcasts",
    "the Beatles", "video game history", "dark matter", "the International Space Station", "crop rotation",
    "owls", "the Crusades", "the Bronze Age",
]
MORE_CHAT_TEMPLATES = CHAT_TEMPLATES + [
    "Summarize what is known about {t}.",
    "Give me a beginner-friendly explanation of {t}.",
    "What are some surprising facts about {t}?",
    "Write a short explainer on {t} for a school newsletter.",
    "How has our understanding of {t} changed over time?",
    "List five key terms related to {t} and define each.",
]
MORE_ADVICE_ACTIVITIES = [
    "learning to swim as an adult", "writing a personal budget", "getting up earlier in the morning",
    "learning to draw", "moving to a new apartment", "preparing for a final exam", "starting a small online shop",
    "learning to code", "keeping a journal", "hosting a dinner party", "negotiating a salary", "reading more books",
    "learning to juggle", "taking better photos with a phone", "choosing a first car", "running a book club",
    "decluttering a closet", "managing stress before exams", "staying motivated at the gym", "learning to knit",
    "improving my handwriting", "baking a birthday cake", "caring for a pet rabbit", "giving constructive feedback",
    "writing a cover letter", "planning a camping weekend", "learning basic car maintenance",
    "organizing my digital photos", "becoming a better listener", "cycling to work",
]
MORE_ADVICE_TEMPLATES = ADVICE_TEMPLATES + [
    "What are common mistakes people make when {a}?",
    "Make a one-week plan for {a}.",
    "How can I get better at {a}?",
]
MORE_COMPARISONS = [
    ("a gas car", "an electric car"), ("online classes", "in-person classes"), ("a credit card", "a debit card"),
    ("paper maps", "GPS navigation"), ("working from home", "working in an office"),
    ("a savings account", "index funds"), ("vinyl records", "streaming music"), ("board games", "video games"),
    ("a house", "an apartment"), ("public transport", "driving to work"), ("hardcover", "paperback books"),
    ("yoga", "pilates"), ("a startup job", "a corporate job"), ("learning Spanish", "learning French"),
    ("cooking at home", "eating out"), ("a tablet", "a laptop for students"),
    ("solar water heaters", "electric water heaters"), ("camping", "staying in hotels"),
    ("freelancing", "full-time employment"), ("wool", "cotton clothing"),
]
MORE_CODE_LANGUAGES = CODE_LANGUAGES + ["C++", "Ruby", "Kotlin", "Swift"]
MORE_CODE_TASKS = [
    "checks whether a list is sorted", "finds the most common element in a list",
    "generates the first n prime numbers", "reverses the order of the words in a sentence",
    "removes all whitespace from a string", "computes the product of a list of numbers",
    "finds all divisors of a number", "counts the number of words in a string",
    "checks whether a number is a perfect square", "merges two dictionaries", "finds the minimum and maximum of a list in one pass",
    "implements a simple stack class", "implements a queue using two stacks", "splits a list into chunks of size n",
    "computes the Levenshtein distance between two strings", "checks whether a number is an Armstrong number",
    "converts a binary string to an integer", "computes the dot product of two vectors",
    "finds the missing number in a list containing 1 to n", "checks whether a string contains only digits",
    "computes the n-th triangular number", "returns the unique characters of a string", "implements insertion sort",
    "implements quicksort", "computes compound interest over a number of years", "parses one CSV line into fields",
    "finds the first non-repeating character in a string", "counts the set bits of an integer",
    "checks whether two rectangles overlap", "formats a number of seconds as hours, minutes and seconds",
]  # fmt: skip
MORE_CODE_CONCEPTS = [
    ("a library", "a framework"), ("mutable", "immutable data"), ("a shallow copy", "a deep copy"),
    ("static typing", "dynamic typing"), ("a virtual machine", "a container"), ("REST", "GraphQL"),
    ("a linked list", "an array"), ("breadth-first search", "depth-first search"), ("a mutex", "a semaphore"),
    ("JSON", "XML"), ("cookies", "local storage in a browser"), ("a primary key", "a foreign key"),
    ("stack memory", "heap memory"), ("an API", "an SDK"), ("lazy", "eager evaluation"),
]
MORE_CODE_SNIPPETS = [
    "x = [i for i in range(10)]\nprint(sum(x) / len(x))",
    "def is_even(n):\n    return n % 2 == 0",
    "fetch(url).then(r => r.json()).then(data => console.log(data.length));",
    "UPDATE users SET active = 0 WHERE last_login < '2023-01-01';",
    "while (i < n && a[i] != key) i++;",
    "counts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    "fn add(a: i32, b: i32) -> i32 { a + b }",
    "ls -la | grep '.py' | wc -l",
]
MORE_SQL_TASKS = [
    "finds customers who have never placed an order", "returns the total revenue per product category",
    "lists the five most recent orders", "finds duplicate email addresses in a users table",
    "counts employees hired each year", "finds products that are out of stock", "returns the second highest salary",
    "shows each order together with the name of the customer who placed it",
]
MORE_WRITING_SUBJECTS = [
    "a snowy mountain cabin", "a harbor at sunrise", "an old bookstore", "a crowded beach in August",
    "a dragon who is afraid of the dark", "a spaceship leaving Earth", "a quiet village festival",
    "a child's first day at school", "a clock that runs backwards", "a fox in the snow", "a hot air balloon ride",
    "an empty stadium", "a bakery at five in the morning", "a letter from the future", "a river in flood",
    "the smell of rain", "a lonely astronaut", "a jazz club at midnight", "a farmers' market in summer",
    "a stray dog finding a home", "a broken radio", "an island with no name", "a bridge in the fog",
    "the last train home", "a wedding in the rain", "a secret door in a museum", "a tree that is a hundred years old",
    "a kite on a windy day", "a night market", "a chess game in a park",
]
MORE_WRITING_TEMPLATES = WRITING_TEMPLATES + [
    "Write a four-line rhyming poem about {s}.",
    "Write a diary entry about {s}.",
    "Write a short dialogue set around {s}.",
]
MORE_EMAILS = [
    ("my bank", "a card payment I did not make"), ("my landlord", "renewing my lease"),
    ("a job applicant", "an invitation to a second interview"), ("my son's school", "a missed homework assignment"),
    ("a gym", "cancelling my membership"), ("an airline", "a lost suitcase"),
    ("a client", "a project deadline that will slip by a week"), ("the IT department", "a laptop that will not start"),
    ("a conference organizer", "submitting a talk proposal"), ("a plumber", "a leaking kitchen pipe"),
]
MORE_EMAIL_TEMPLATES = EMAIL_TEMPLATES + ["Write a friendly but firm email to {to} about {about}."]
MORE_PRODUCTS = [
    "a foldable electric scooter", "a cast-iron skillet", "a wireless keyboard", "a yoga mat",
    "a kids' tablet with parental controls", "a sunrise alarm clock", "a waterproof phone case", "an air purifier",
    "a set of reusable beeswax wraps", "a portable projector", "a mechanical pencil", "a robot vacuum cleaner",
]
REVIEWED = ["these headphones", "this coffee machine", "this laptop", "this backpack"]


# --- the third batch of training prompts (thirty-fifth session) -----------------------------------------
# New topics again, and task types of everyday chat use that the first two batches lacked: translation,
# rewriting, trip and meal planning, idea lists, trivia, thank-you notes, limericks, recipes, time and
# proportion arithmetic, equations with unknowns on both sides, receipts of other shops, schedules. Some of
# these types also occur in the held-out set; its own topics, sentences and numbers stay out of training
# (`_check_reserved_topics` and `tests/runtime/test_prompts.py` check the reserved topics and the strings).
THIRD_CHAT_TOPICS = [
    "the Great Barrier Reef", "the water purification process", "the game of chess", "comets",
    "anesthesia", "the Hundred Years' War", "bees and pollination", "the invention of the telephone", "quasars",
    "the Andes mountains", "solar eclipses", "tea growing", "the Arctic", "the printing of newspapers",
    "whales", "the human eye", "the Olympic marathon", "the stock exchange", "caves and stalactites",
    "the Gold Rush", "rice farming", "the piano", "lighthouses", "the jet stream", "ant colonies",
    "the Great Fire of London", "the Trans-Siberian Railway", "the human liver", "soap making",
    "the Dutch Golden Age", "superconductors", "the Galapagos Islands", "pandas", "mapmaking",
    "the Fibonacci sequence in nature", "the invention of glass", "hot springs", "the Antarctic Treaty",
    "the human lungs", "cheese making", "the Hubble constant", "the Incas", "radio waves",
    "early writing systems", "seed banks", "the Persian Empire", "coral bleaching", "the zipper",
    "kangaroos", "the Amazon River", "the Rosetta Stone", "solar sails", "umbrellas",
    "sand dunes", "the Cuban Missile Crisis", "the human kidneys", "Fresnel lenses",
    "hummingbirds", "the Channel Tunnel", "the spice trade", "neutron stars", "the Harlem Renaissance",
    "the Gregorian calendar", "termite mounds", "the Taj Mahal", "electric eels", "the Congo rainforest",
    "cacao farming", "sundials", "the Apollo 13 mission", "snowflakes", "the Qin dynasty",
    "the postal service", "geysers", "knitting", "the Dust Bowl", "red pandas",
    "the life cycle of stars", "the toothbrush", "fjords",
]  # fmt: skip
THIRD_CHAT_TEMPLATES = [
    "Describe the basics of {t}.",
    "What is the history of {t}?",
    "Teach me about {t} in five bullet points.",
    "What would a student need to know about {t} for a quiz?",
    "Give a two-paragraph introduction to {t}.",
    "Why do people find {t} fascinating?",
    "What are three myths about {t}, and what is the truth?",
    "Explain {t} as if I were a curious adult with no science background.",
]
COUNTRIES = [
    "Canada", "Japan", "Brazil", "Kenya", "Norway", "Egypt", "Argentina", "Vietnam", "Poland", "Morocco",
    "Chile", "Thailand", "Portugal", "Ghana", "Finland", "Peru", "Turkey", "Indonesia", "Ireland", "Mexico",
    "South Korea", "New Zealand", "Greece", "Colombia", "Sweden", "Nigeria", "Switzerland", "India",
]
TRIVIA_TEMPLATES = [
    "What is the capital of {c}?",
    "What languages are spoken in {c}?",
    "Name three famous dishes from {c}.",
    "Tell me a few facts about the geography of {c}.",
]
PLAN_CITIES = [("Paris", "art"), ("Kyoto", "temples"), ("Barcelona", "architecture"), ("London", "museums"),
               ("Istanbul", "food"), ("Cape Town", "nature"), ("New York", "theatre"), ("Vienna", "music"),
               ("Mexico City", "history"), ("Edinburgh", "castles"), ("Seoul", "shopping"), ("Prague", "old towns"),
               ("Amsterdam", "cycling"), ("Buenos Aires", "dancing"), ("Marrakesh", "markets"), ("Vancouver", "hiking")]
PLAN_TEMPLATES = [
    "Plan a {n}-day trip to {city} for someone who loves {x}.",
    "I have {n} days in {city} and I love {x}. What should I do each day?",
]
MEAL_PLANS = ["a vegetarian", "a student on a tight budget", "a family of four", "someone training for a marathon",
              "a person who hates cooking", "someone avoiding gluten", "a busy nurse on night shifts",
              "a beginner cook"]  # fmt: skip
IDEA_LISTS = [
    "weekend activities for a rainy day", "gift ideas for a ten-year-old", "names for a small bakery",
    "team-building activities for a remote team", "cheap date ideas", "hobbies that can be done at home",
    "ways to save energy at home", "science fair projects for middle school", "themes for a costume party",
    "questions to ask at the end of a job interview", "podcast episode topics about history",
    "ways to reduce food waste", "blog post ideas for a travel website", "easy houseplants for beginners",
    "ways to celebrate a colleague's retirement", "fun facts to start a presentation",
    "snacks for a long car journey", "ways to practice a new language every day", "lunch ideas for work",
    "games to play with a group of children",
]
IDEA_TEMPLATES = ["Give me a list of {n} {x}.", "Suggest {n} {x}, with one sentence on each."]
TRANSLATE_SENTENCES = [
    "How much does this ticket cost?", "I would like a table for two, please.", "Can you help me find my hotel?",
    "The museum opens at nine in the morning.", "I am allergic to peanuts.", "What time does the last bus leave?",
    "My phone battery is almost empty.", "Could you speak a little more slowly?", "We are looking for a pharmacy.",
    "It is raining, so take an umbrella.", "Thank you very much for your help.", "I lost my wallet yesterday.",
    "Is breakfast included in the price?", "The meeting has been moved to Thursday.",
    "How do I get to the airport from here?", "I would like to return this jacket.",
]
TRANSLATE_LANGUAGES = ["Spanish", "French", "German", "Italian", "Portuguese", "Dutch"]
INFORMAL_SENTENCES = [
    "gonna be late, traffic is crazy", "can u check the numbers again pls", "thx for the help yesterday!!",
    "the meeting was kinda pointless tbh", "need the files by tmrw or we're in trouble",
    "lol the printer broke again", "hey whats the plan for friday", "sry i forgot to call u back",
    "this app is super buggy and slow", "we should totally grab lunch sometime",
    "dunno if the budget will work out", "the client wants like a million changes",
]
REWRITE_TEMPLATES = [
    "Make this message more polite: \"{m}\"",
    "Rewrite this in clear, professional English: \"{m}\"",
    "Fix the spelling and grammar of this message: \"{m}\"",
    "Turn this text message into a short formal email: \"{m}\"",
]
THANKS = [("a nurse", "cared for my father in hospital"), ("a neighbour", "watered my plants while I was away"),
          ("a coach", "helped our team reach the final"), ("a colleague", "covered my shifts last week"),
          ("a librarian", "helped me find sources for my thesis"), ("a friend", "helped me move house"),
          ("a mentor", "reviewed my first research paper"), ("a host family", "welcomed me for a summer"),
          ("a bus driver", "returned my lost bag"), ("a volunteer", "organized the charity run")]
THANKS_TEMPLATES = ["Write a short thank-you note to {who} who {did}.", "Write a warm thank-you card message for {who} who {did}."]
LIMERICK_SUBJECTS = ["a cat who loves jazz", "a chef who cannot boil water", "a sleepy astronaut", "a giraffe in a car",
                     "a pirate who gets seasick", "a dog who works in an office", "a snail in a hurry",
                     "a ghost who is scared of people", "a baker who sneezes", "a knight afraid of horses"]
RECIPES = ["a simple tomato soup", "pancakes for four people", "a quick vegetable stir-fry", "guacamole",
           "banana bread", "a lentil curry", "overnight oats", "a Greek salad", "homemade pizza dough",
           "a chocolate mug cake", "roasted vegetables", "scrambled eggs done well"]
RECIPE_TEMPLATES = ["Write a simple recipe for {r}.", "List the ingredients and steps for {r}."]
THIRD_CODE_TASKS = [
    "checks whether a string is a valid hexadecimal color code", "counts the number of uppercase letters in a string",
    "returns the k largest elements of a list", "computes the cumulative product of a list",
    "groups a list of words by their first letter", "converts a string to title case",
    "returns the indices of all occurrences of a value in a list", "checks whether a matrix is symmetric",
    "computes the number of days between two dates", "generates all permutations of a short string",
    "removes vowels from a string", "finds the longest common prefix of a list of strings",
    "converts snake_case to camelCase", "computes the sum of a list without using a built-in sum",
    "checks whether a number is a power of two", "returns the mode of a list of numbers",
    "interleaves two lists", "counts the occurrences of a character in a string",
    "computes the area of a polygon from its vertices", "validates a password against simple rules",
    "returns every other element of a list", "converts temperatures from Fahrenheit to Celsius for a list",
    "implements selection sort", "finds pairs in a list that sum to a target", "reverses a linked list",
    "computes the digital root of a number", "masks all but the last four digits of a card number",
    "returns the n-th row of Pascal's triangle", "checks whether a sentence is a pangram",
    "computes the Hamming distance between two strings",
]
THIRD_CODE_LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "Java", "C#", "Ruby", "TypeScript", "C++", "PHP"]
THIRD_CODE_QUESTIONS = [
    "How do I read a JSON file in Python?", "What does the `yield` keyword do in Python?",
    "How do I handle errors with try and except in Python?", "What is a closure in JavaScript?",
    "How do I undo the last git commit?", "What is the difference between == and === in JavaScript?",
    "How do I create a virtual environment in Python?", "What does `async` and `await` mean?",
    "How do I sort a list of dictionaries by a key in Python?", "What is Big O notation?",
    "How do I make an HTTP request in Python?", "What is a race condition?",
    "How do I write a unit test with pytest?", "What is dependency injection?",
    "How do I remove a file from a git repository but keep it locally?", "What is a SQL index and when should I add one?",
]  # fmt: skip
THIRD_SQL_TASKS = [
    "lists the products that have never been ordered", "finds the month with the highest sales",
    "returns each department with its number of employees", "finds customers who placed more than three orders",
    "computes the running total of sales by day", "lists orders placed on weekends",
    "finds the most popular product in each category", "returns users who signed up in the last 30 days",
]
SHOP_ITEMS = [("notebook", 4), ("pen set", 7), ("desk lamp", 29), ("coffee mug", 9), ("backpack", 45),
              ("water bottle", 15), ("umbrella", 18), ("phone charger", 22), ("scarf", 25), ("candle", 12)]
HOTEL_ASPECTS = [("the breakfast", "was fresh and varied"), ("the room", "smelled of smoke"),
                 ("the staff", "were friendly"), ("the wifi", "kept dropping"), ("the location", "was perfect"),
                 ("the bed", "was too soft"), ("the pool", "was closed all week"), ("check-in", "took five minutes")]


# --- held-out: topics and templates never used in training -----------------------------------------
HELDOUT_CHAT_TOPICS = ["volcanoes", "the human brain", "paper money", "the Northern Lights", "submarines",
                       "the history of the bicycle", "octopuses", "the metric system"]
HELDOUT_CHAT_TEMPLATES = ["Explain {t} in simple terms.", "How does {t} work, briefly?"]
HELDOUT_CODE_TASKS = ["counts the lines in a text file", "checks whether a year is a leap year",
                      "returns the longest word in a sentence", "converts a list of pairs into a dictionary",
                      "computes the median of a list of numbers", "shuffles a deck of cards"]
HELDOUT_CODE_LANGUAGES = ["Python", "JavaScript"]
HELDOUT_WRITING_SUBJECTS = ["a lighthouse keeper's last night", "a garden in spring", "an abandoned amusement park",
                            "a violin in a pawn shop"]
HELDOUT_EXTRA = [
    ("chat", "What is the capital of Australia, and why is it not Sydney?"),
    ("chat", "Plan a three-day trip to Rome for someone who loves history."),
    ("writing", "Write a limerick about a forgetful wizard."),
    ("math", "If a train leaves at 14:35 and the journey takes 2 hours and 50 minutes, when does it arrive?"),
    ("math", "A recipe needs 3 eggs for 12 muffins. How many eggs are needed for 30 muffins?"),
    ("math", "Solve for y: 5y - 9 = 3y + 7."),
    ("math", "What is 18% of 450?"),
    ("extraction", "Extract the product names and prices from this text as JSON:\nThe Alpine tent costs $249, "
                   "the TrailLite stove is $59 and the Summit sleeping bag sells for $179."),
    ("extraction", "Classify the sentiment of this review as positive, negative or mixed: \"The hotel room was "
                   "spotless, but the staff ignored our complaints about the noise.\""),
    ("writing", "Rewrite this sentence in a more formal tone: \"Hey, can u send me the report asap?\""),
    ("chat", "Give me a list of five healthy breakfast ideas."),
    ("chat", "What are the pros and cons of working a four-day week?"),
    ("code", "Write a SQL query that finds the three cities with the most registered users."),
    ("chat", "Explain the difference between weather and climate."),
    ("writing", "Translate \"Where is the nearest train station?\" into Spanish and French."),
    ("writing", "Write a short thank-you note to a teacher who helped me prepare for an exam."),
]


def _cycle_pick(items: list, i: int, k: int) -> list:
    """k items of ``items`` starting at i with a stride co-prime to typical list sizes (deterministic)."""
    return [items[(i + 3 * j) % len(items)] for j in range(k)]


def _math_problems() -> list[str]:
    out = []
    for i in range(40):
        a, b = 3 + (7 * i) % 23, 2 + (5 * i) % 17
        name, other = NAMES[i % len(NAMES)], NAMES[(i + 5) % len(NAMES)]
        item = ITEMS[i % len(ITEMS)]
        kind = i % 5
        if kind == 0:
            out.append(f"{name} has {a + b} {item} and gives {b} to {other}. How many {item} does {name} have left?")
        elif kind == 1:
            out.append(f"{name} buys {a} packs of {item} with {b} in each pack. How many {item} is that in total?")
        elif kind == 2:
            out.append(f"A car travels {a * 10} km in {b % 5 + 1} hours. What is its average speed?")
        elif kind == 3:
            out.append(f"{name} and {other} share {a * b} {item} equally. How many does each get?")
        else:
            out.append(f"A shirt costs ${a * 4} and is on sale for {5 * (b % 6 + 1)}% off. What is the sale price?")
    for i in range(25):
        a, b, x = 2 + i % 7, 1 + (3 * i) % 11, 1 + (5 * i) % 9
        out.append(f"Solve for x: {a}x + {b} = {a * x + b}.")
    for i in range(20):
        p, n = 5 * (1 + i % 9), 40 + 20 * i
        out.append(f"What is {p}% of {n}?")
    for i in range(12):
        shape, dims, what = SHAPES[i % len(SHAPES)]
        a, b, c = 2 + i, 3 + (2 * i) % 7, 4 + i % 5
        out.append(f"What is the {what} of a {shape} with {dims.format(a=a, b=b, c=c)}?")
    for i, concept in enumerate(MATH_CONCEPTS):
        out.append(["What is {c}? Give an example.", "Explain {c} with a simple example."][i % 2].format(c=concept))
    for i in range(10):
        a, b = 12 + 7 * i, 3 + i
        out.append(f"Is {a * b + 1} a prime number? Explain your reasoning.")
    return out


def _more_math_problems() -> list[str]:
    out = []
    for i in range(20):
        a, b, c = 4 + (7 * i) % 31, 10 + (3 * i) % 19, 1 + (11 * i) % 23
        out.append(f"What is the average of {a}, {b} and {c}?")
    for i in range(15):
        a, b, c, d = 1 + i % 4, 2 + i % 5 + i % 4, 1 + (2 * i) % 5, 3 + (3 * i) % 7
        out.append(f"What is {a}/{b} + {c}/{d}? Simplify the result.")
    for i in range(10):
        out.append(f"How many minutes are there in {1 + i % 5} hours and {5 * (1 + (3 * i) % 11)} minutes?")
    for i in range(10):
        out.append(f"Convert {1.5 + 2.25 * i} kilometers to meters.")
    for i in range(10):
        p, r, t = 500 * (1 + i % 7), 2 + i % 5, 1 + (3 * i) % 6
        out.append(f"If you invest ${p} at {r}% simple interest a year, how much interest do you earn in {t} years?")
    for i in range(10):
        a, b = 3 + (5 * i) % 17, 2 + (7 * i) % 13
        out.append(f"What is the perimeter of a rectangle with sides {a} m and {b} m?")
    for i in range(10):
        p, n = 10 + 5 * (i % 6), 120 + 40 * i
        out.append(f"{NAMES[(i + 3) % len(NAMES)]} reads {p} pages a day. How many days does a {n}-page book take?")
    return out


def _third_math_problems() -> list[str]:
    out = []
    for i in range(16):
        h, m, d = 8 + (5 * i) % 13, (7 * i) % 12 * 5, 35 + (17 * i) % 150
        out.append(f"A film starts at {h}:{m:02d} and lasts {d} minutes. At what time does it end?")
    for i in range(14):
        h, m, dh, dm = 6 + (3 * i) % 15, (11 * i) % 12 * 5, 1 + i % 4, (7 * i) % 12 * 5
        out.append(f"A bus leaves at {h}:{m:02d} and the ride takes {dh} hours and {dm} minutes. When does it arrive?")
    for i in range(16):
        a, b, c = 2 + i % 4, 8 + 4 * (i % 5), 20 + 6 * i
        thing, dish = [("cups of flour", "pancakes"), ("bananas", "smoothies"), ("spoons of sugar", "cookies"),
                       ("onions", "portions of soup")][i % 4]  # fmt: skip
        out.append(f"A recipe uses {a} {thing} for {b} {dish}. How many {thing} are needed for {c} {dish}?")
    for i in range(20):
        a, c = 4 + i % 6, 1 + i % 3
        x = 2 + (3 * i) % 9
        b = 3 + (5 * i) % 13
        d = (a - c) * x - b  # a x - b = c x + d, solved by x
        right = ("x" if c == 1 else f"{c}x") + (f" + {d}" if d > 0 else f" - {-d}" if d < 0 else "")
        out.append(f"Solve for x: {a}x - {b} = {right}.")
    for i in range(12):
        w, r = 40 + 15 * i, 4 + i % 6
        out.append(f"A worker earns ${r * 5} an hour and works {w // 5} hours a week. What does she earn in a week?")
    for i in range(12):
        p, d = 20 + 15 * i, 10 + 5 * (i % 7)
        out.append(f"A jacket costs ${p}. After a {d}% discount, what is the new price, and how much is saved?")
    for i in range(10):
        a, b = 12 + 9 * i, 3 + i % 5
        out.append(f"{NAMES[i % len(NAMES)]} runs {b} km a day. How many days does it take to run {a} km?")
    return out


def _shop_text(i: int) -> str:
    picks = [SHOP_ITEMS[(i + 3 * j) % len(SHOP_ITEMS)] for j in range(3)]
    shop = COMPANIES[(i + 2) % len(COMPANIES)]
    parts = [f"the {name} is ${price + i % 5}" for name, price in picks]
    return f"At {shop} this week {parts[0]}, {parts[1]} and {parts[2]}."


def _hotel_review(i: int) -> str:
    (a1, s1), (a2, s2) = HOTEL_ASPECTS[i % len(HOTEL_ASPECTS)], HOTEL_ASPECTS[(i + 3) % len(HOTEL_ASPECTS)]
    return f"\"We stayed {2 + i % 6} nights in {CITIES[i % len(CITIES)]}. {a1.capitalize()} {s1}, and {a2} {s2}.\""


def _schedule(i: int) -> str:
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
    events = ["dentist", "team meeting", "piano lesson", "parcel delivery", "dinner with " + NAMES[(i + 1) % len(NAMES)],
              "gym class", "car service", "school play"]
    rows = [f"{days[(i + j) % 5]} {8 + (3 * i + 4 * j) % 10}:00 {events[(i + 2 * j) % len(events)]}" for j in range(4)]
    return "\n".join(rows)


def _voicemail(i: int) -> str:
    name, company = NAMES[(i + 5) % len(NAMES)], COMPANIES[(i + 4) % len(COMPANIES)]
    about = ["the delayed shipment", "your invoice", "next week's workshop", "the contract renewal"][i % 4]
    domain = company.lower().replace(" ", "")
    return (
        f"Voicemail: this is {name} calling from {company} about {about}. Please call back on +44 20 7946 "
        f"{1000 + 37 * i} or email {name.lower()}@{domain}.com by {MONTHS[(i + 2) % 12]} {1 + (5 * i) % 28}."
    )


def _third_extraction() -> list[str]:
    out = ["List each item and its price from this text:\n" + _shop_text(i) for i in range(20)]
    out += ["Classify the sentiment of this hotel review as positive, negative or mixed: " + _hotel_review(i)
            for i in range(16)]  # fmt: skip
    out += ["List the good and the bad points of this stay: " + _hotel_review(i + 16) for i in range(12)]
    out += ["Turn this schedule into a JSON list with the fields day, time and event:\n" + _schedule(i) for i in range(16)]
    out += ["Which events in this schedule happen before noon?\n" + _schedule(i + 16) for i in range(8)]
    out += ["Extract the caller's name, phone number, email address and deadline from this voicemail:\n" + _voicemail(i)
            for i in range(12)]  # fmt: skip
    out += ["Summarize these meeting notes in two sentences:\n" + _meeting_notes(i + 32) for i in range(12)]
    out += ["What is the total of this receipt? Show the sum:\n" + _receipt(i + 32) for i in range(12)]
    return out


def _third_batch() -> list[tuple[str, str]]:
    """The thirty-fifth session's batch: new topics through the shared builder, then the new task types."""
    recs = _batch(
        THIRD_CHAT_TOPICS, THIRD_CHAT_TEMPLATES, [], ADVICE_TEMPLATES, [], THIRD_CODE_TASKS, THIRD_CODE_LANGUAGES, [],
        [], THIRD_SQL_TASKS, _third_math_problems(), LIMERICK_SUBJECTS, ["Write a limerick about {s}."], THANKS,
        [], [], _third_extraction(),
    )  # fmt: skip
    for i, country in enumerate(COUNTRIES):
        recs += [("chat", t.format(c=country)) for t in _cycle_pick(TRIVIA_TEMPLATES, i, 2)]
    for i, (city, likes) in enumerate(PLAN_CITIES):
        recs.append(("chat", PLAN_TEMPLATES[i % 2].format(n=2 + i % 4, city=city, x=likes)))
    for who in MEAL_PLANS:
        recs.append(("chat", f"Make a one-week meal plan for {who}."))
    for i, idea in enumerate(IDEA_LISTS):
        recs.append(("chat", IDEA_TEMPLATES[i % 2].format(n=[3, 5, 7, 10][i % 4], x=idea)))
    for question in THIRD_CODE_QUESTIONS:
        recs.append(("code", question))
    for i, sentence in enumerate(TRANSLATE_SENTENCES):
        a, b = TRANSLATE_LANGUAGES[i % 6], TRANSLATE_LANGUAGES[(i + 2) % 6]
        recs.append(("writing", f"Translate \"{sentence}\" into {a}."))
        recs.append(("writing", f"How do you say \"{sentence}\" in {b}?"))
    for i, message in enumerate(INFORMAL_SENTENCES):
        recs += [("writing", t.format(m=message)) for t in _cycle_pick(REWRITE_TEMPLATES, i, 2)]
    for i, (who, did) in enumerate(THANKS):
        recs.append(("writing", THANKS_TEMPLATES[i % 2].format(who=who, did=did)))
    for recipe in RECIPES:
        recs += [("writing", t.format(r=recipe)) for t in RECIPE_TEMPLATES]
    return recs


def _passage(i: int) -> str:
    p1, p2 = NAMES[i % len(NAMES)], NAMES[(i + 4) % len(NAMES)]
    c1, c2 = CITIES[i % len(CITIES)], CITIES[(i + 3) % len(CITIES)]
    m1, m2 = MONTHS[i % 12], MONTHS[(i + 5) % 12]
    d1, d2 = 1 + (3 * i) % 28, 1 + (11 * i) % 28
    co = COMPANIES[i % len(COMPANIES)]
    return (
        f"On {m1} {d1}, {2019 + i % 6}, {p1} moved from {c1} to {c2} to join {co}. "
        f"A colleague, {p2}, visited the new office on {m2} {d2} and signed a contract worth "
        f"${(i + 2) * 1250:,}."
    )


def _review(i: int) -> str:
    (a1, s1), (a2, s2) = REVIEW_ASPECTS[i % len(REVIEW_ASPECTS)], REVIEW_ASPECTS[(i + 3) % len(REVIEW_ASPECTS)]
    return f"\"I bought this phone last month. The {a1} {s1}, but the {a2} {s2}.\""


def _meeting_notes(i: int) -> str:
    a, b, c = NAMES[i % len(NAMES)], NAMES[(i + 2) % len(NAMES)], NAMES[(i + 7) % len(NAMES)]
    m = MONTHS[(i + 1) % 12]
    return (
        f"Meeting notes: {a} will send the budget draft by {m} {3 + i % 20}. {b} asked for more test data; "
        f"{c} agreed to collect it before the next sprint. The launch in {CITIES[(i + 1) % len(CITIES)]} "
        f"moves to {MONTHS[(i + 4) % 12]}."
    )


def _receipt(i: int) -> str:
    lines = [f"{ITEMS[(i + j) % len(ITEMS)]} x{1 + (i + 2 * j) % 4} ${(3 + (5 * i + 7 * j) % 20)}.{(25 * j) % 100:02d}"
             for j in range(3)]
    return f"Receipt from {COMPANIES[(i + 3) % len(COMPANIES)]}, {CITIES[(i + 5) % len(CITIES)]}:\n" + "\n".join(lines)


def _contact_message(i: int) -> str:
    name = NAMES[(i + 9) % len(NAMES)]
    return (
        f"Hi, this is {name} from {COMPANIES[(i + 1) % len(COMPANIES)]}. Call me at +1 555 01{10 + i:02d} "
        f"or write to {name.lower()}.{i}@example.com before {MONTHS[(i + 6) % 12]} {10 + i % 19}."
    )


def _batch(chat_topics, chat_templates, advice, advice_templates, comparisons, code_tasks, code_languages, concepts,
           snippets, sql_tasks, math, subjects, writing_templates, emails, email_templates, products, extraction):  # fmt: skip
    """One batch of training prompts, category by category, from its lists (``extraction``: its prompts, made
    by the caller since each batch indexes the passage builders differently)."""
    recs: list[tuple[str, str]] = []
    for i, topic in enumerate(chat_topics):
        recs += [("chat", t.format(t=topic)) for t in _cycle_pick(chat_templates, i, 4)]
    for i, act in enumerate(advice):
        recs += [("chat", t.format(a=act)) for t in _cycle_pick(advice_templates, i, 2)]
    for a, b in comparisons:
        recs.append(("chat", f"What are the pros and cons of {a} versus {b}?"))
    for i, task in enumerate(code_tasks):
        for j, lang in enumerate(_cycle_pick(code_languages, i, 4)):
            recs.append(("code", CODE_TEMPLATES[(i + j) % len(CODE_TEMPLATES)].format(lang=lang, task=task)))
    for a, b in concepts:
        recs.append(("code", f"What is the difference between {a} and {b}?"))
    for code in snippets:
        recs += [("code", t.format(code=code)) for t in SNIPPET_TEMPLATES]
    for task in sql_tasks:
        recs.append(("code", f"Write a SQL query that {task}."))
    recs += [("math", p) for p in math]
    for i, subject in enumerate(subjects):
        recs += [("writing", t.format(s=subject)) for t in _cycle_pick(writing_templates, i, 3)]
    for to, about in emails:
        recs += [("writing", t.format(to=to, about=about)) for t in email_templates]
    for product in products:
        recs += [("writing", t.format(p=product)) for t in PRODUCT_TEMPLATES]
    return recs + [("extraction", p) for p in extraction]


def _extraction(passages: range, notes: range, receipts: range, contacts: range) -> list[str]:
    out = [EXTRACTION_TASKS[i % len(EXTRACTION_TASKS)].format(text=_passage(i)) for i in passages]
    out += ["List the action items in these notes, with owner and deadline:\n" + _meeting_notes(i) for i in notes]
    out += ["Turn this receipt into JSON with the fields item, quantity and price, and give the total:\n" + _receipt(i)
            for i in receipts]  # fmt: skip
    out += ["Extract the name, phone number, email address and deadline from this message:\n" + _contact_message(i)
            for i in contacts]  # fmt: skip
    return out


def training_records() -> list[dict]:
    first = _batch(
        CHAT_TOPICS, CHAT_TEMPLATES, ADVICE_ACTIVITIES, ADVICE_TEMPLATES, COMPARISONS, CODE_TASKS, CODE_LANGUAGES,
        CODE_CONCEPTS, CODE_SNIPPETS, SQL_TASKS, _math_problems(), WRITING_SUBJECTS, WRITING_TEMPLATES, EMAILS,
        EMAIL_TEMPLATES, PRODUCTS,
        _extraction(range(40), range(16), range(16), range(12))
        + [REVIEW_TASKS[i % 2].format(r=_review(i)) for i in range(24)],
    )  # fmt: skip
    # The thirty-third session's second batch, appended (the held-out set's passages are 100..103).
    reviews = []
    for i in range(32):
        (a1, s1), (a2, s2) = REVIEW_ASPECTS[i % len(REVIEW_ASPECTS)], REVIEW_ASPECTS[(i + 5) % len(REVIEW_ASPECTS)]
        review = f"\"I have used {REVIEWED[i % len(REVIEWED)]} for {2 + i % 9} weeks. The {a1} {s1}, and the {a2} {s2}.\""
        reviews.append(REVIEW_TASKS[(i // 4) % 2].format(r=review))
    second = _batch(
        MORE_CHAT_TOPICS, MORE_CHAT_TEMPLATES, MORE_ADVICE_ACTIVITIES, MORE_ADVICE_TEMPLATES, MORE_COMPARISONS,
        MORE_CODE_TASKS, MORE_CODE_LANGUAGES, MORE_CODE_CONCEPTS, MORE_CODE_SNIPPETS, MORE_SQL_TASKS,
        _more_math_problems(), MORE_WRITING_SUBJECTS, MORE_WRITING_TEMPLATES, MORE_EMAILS, MORE_EMAIL_TEMPLATES,
        MORE_PRODUCTS, _extraction(range(40, 90), range(16, 32), range(16, 32), range(12, 24)) + reviews,
    )  # fmt: skip
    return _dedupe(first + second + _third_batch())


def heldout_records() -> list[dict]:
    recs: list[tuple[str, str]] = []
    for topic in HELDOUT_CHAT_TOPICS:
        recs += [("chat", t.format(t=topic)) for t in HELDOUT_CHAT_TEMPLATES]
    for i, task in enumerate(HELDOUT_CODE_TASKS):
        recs.append(("code", f"Write a {HELDOUT_CODE_LANGUAGES[i % 2]} function that {task}."))
    for subject in HELDOUT_WRITING_SUBJECTS:
        recs += [("writing", f"Write a short poem about {subject}."),
                 ("writing", f"Describe {subject} in vivid detail.")]
    for i in range(6):
        a, b = 9 + 4 * i, 6 + 3 * i
        recs.append(("math", f"A bakery sells {a} loaves in the morning and {b} in the afternoon. "
                             f"Each loaf costs $3. How much money does it make in a day?"))
    for i in range(4):
        j = 100 + i  # indices past the training passages, so names/dates/amounts combine differently
        recs.append(("extraction", "Extract every company name and amount of money from this text:\n" + _passage(j)))
    recs += HELDOUT_EXTRA
    return _dedupe(recs)


def _dedupe(recs: list[tuple[str, str]]) -> list[dict]:
    seen: dict[str, str] = {}
    for category, prompt in recs:
        seen.setdefault(prompt, category)
    return [{"category": c, "prompt": p} for p, c in seen.items()]


def _check_reserved_topics() -> None:
    # The held-out set is only honest if its topics never reach training, not just its strings.
    train_text = "\n".join(r["prompt"] for r in training_records()).lower()
    for topic in HELDOUT_CHAT_TOPICS + HELDOUT_CODE_TASKS + HELDOUT_WRITING_SUBJECTS:
        assert topic.lower() not in train_text, f"held-out topic {topic!r} appears in training prompts"


def render(name: str) -> str:
    records = {"train": training_records, "heldout": heldout_records}[name]()
    doc = {"name": name, "format_version": FORMAT_VERSION, "generator": "treecompile/data/build_prompts.py",
           "count": len(records), "prompts": records}
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    _check_reserved_topics()
    for name in ("train", "heldout"):
        path = HERE / f"prompts_{name}.json"
        path.write_text(render(name), encoding="utf-8")
        print(f"wrote {path} ({json.loads(path.read_text(encoding='utf-8'))['count']} prompts)")


if __name__ == "__main__":
    main()
