"""The written material the corpus generator draws from: word lists, facts, topic sentences and tool signatures.

Everything here was written for this project (no third-party text). The generator (:mod:`training.corpus`)
combines these pieces with seeded random choices; keeping the material apart keeps the generator's logic short.
Every collection is a tuple or a tuple of tuples, so that iteration order never depends on hashing.
"""

from __future__ import annotations

NAMES = (
    "Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Iris", "Jack", "Lena", "Max", "Nora",
    "Oscar", "Paula", "Ravi", "Sara", "Tom", "Uma", "Victor", "Wendy", "Yusuf", "Zoe", "Alice", "Bob", "Carlos",
    "Dana", "Elena", "Frank", "Hana", "Ivan", "Julia", "Kofi", "Lucy", "Marco", "Nina", "Omar", "Priya", "Rosa",
    "Sam", "Tara", "Leo", "Mia", "Noah", "Ella", "Hugo", "Ada", "Kai",
)  # fmt: skip

# (city, country, one fact about the city)
CITIES = (
    ("Paris", "France", "The Eiffel Tower stands in Paris."),
    ("London", "the United Kingdom", "The river Thames runs through London."),
    ("Berlin", "Germany", "Berlin has more bridges than many people expect."),
    ("Madrid", "Spain", "Madrid sits in the middle of Spain."),
    ("Rome", "Italy", "Rome is famous for its old buildings and fountains."),
    ("Vienna", "Austria", "Vienna is known for music and coffee houses."),
    ("Lisbon", "Portugal", "Lisbon is built on seven hills by the sea."),
    ("Dublin", "Ireland", "Dublin is a city of writers and music."),
    ("Oslo", "Norway", "Oslo lies at the end of a long fjord."),
    ("Stockholm", "Sweden", "Stockholm is built on fourteen islands."),
    ("Helsinki", "Finland", "Helsinki has long summer days and short winter days."),
    ("Copenhagen", "Denmark", "Copenhagen is a city of bicycles."),
    ("Amsterdam", "the Netherlands", "Amsterdam has many canals."),
    ("Brussels", "Belgium", "Brussels is known for its chocolate."),
    ("Prague", "the Czech Republic", "Prague has an old bridge full of statues."),
    ("Warsaw", "Poland", "Warsaw was rebuilt after the war."),
    ("Athens", "Greece", "Athens is one of the oldest cities in the world."),
    ("Cairo", "Egypt", "Cairo lies on the river Nile."),
    ("Nairobi", "Kenya", "Nairobi has a national park inside the city."),
    ("Tokyo", "Japan", "Tokyo is one of the largest cities in the world."),
    ("Seoul", "South Korea", "Seoul mixes old palaces and tall towers."),
    ("Beijing", "China", "Beijing has a long history as a capital."),
    ("Delhi", "India", "Delhi is a very large and busy city."),
    ("Bangkok", "Thailand", "Bangkok is famous for its street food."),
    ("Hanoi", "Vietnam", "Hanoi has many lakes."),
    ("Canberra", "Australia", "Canberra was planned as a capital city."),
    ("Ottawa", "Canada", "Ottawa has a canal that freezes in winter."),
    ("Lima", "Peru", "Lima lies on the coast of the Pacific Ocean."),
    ("Santiago", "Chile", "Santiago has mountains on one side."),
    ("Bern", "Switzerland", "Bern has an old town with covered streets."),
    ("Budapest", "Hungary", "Budapest is split in two by the river Danube."),
    ("Mexico City", "Mexico", "Mexico City is high above the sea."),
    ("Buenos Aires", "Argentina", "Buenos Aires is known for tango."),
    ("Reykjavik", "Iceland", "Reykjavik is the most northern capital of a country."),
)

# Cities a user may ask about that are not capitals (weather, time, distance tools).
OTHER_CITIES = (
    "Sydney", "Toronto", "New York", "Chicago", "Munich", "Milan", "Barcelona", "Lyon", "Hamburg", "Osaka",
    "Zurich", "Porto", "Seville", "Kyoto", "Boston", "Denver", "Glasgow", "Krakow", "Naples", "Vancouver",
)  # fmt: skip

# (animal, plural, legs, sound or None, where it lives, what it eats)
ANIMALS = (
    ("cat", "cats", 4, "meow", "in houses with people", "fish and meat"),
    ("dog", "dogs", 4, "bark", "in houses with people", "meat and biscuits"),
    ("cow", "cows", 4, "moo", "on farms", "grass"),
    ("horse", "horses", 4, "neigh", "on farms and in fields", "grass and hay"),
    ("sheep", "sheep", 4, "baa", "on farms and hills", "grass"),
    ("duck", "ducks", 2, "quack", "near ponds and rivers", "plants and small insects"),
    ("owl", "owls", 2, "hoot", "in forests", "mice and insects"),
    ("fox", "foxes", 4, None, "at the edge of forests", "mice, birds and berries"),
    ("rabbit", "rabbits", 4, None, "in fields and burrows", "grass and carrots"),
    ("bear", "bears", 4, "growl", "in forests and mountains", "fish, berries and honey"),
    ("frog", "frogs", 4, "croak", "near ponds", "insects"),
    ("bee", "bees", 6, "buzz", "in hives", "nectar from flowers"),
    ("spider", "spiders", 8, None, "in webs in quiet corners", "insects"),
    ("ant", "ants", 6, None, "in large colonies under the ground", "seeds and small insects"),
    ("lion", "lions", 4, "roar", "on the grasslands of Africa", "meat"),
    ("elephant", "elephants", 4, "trumpet", "in Africa and Asia", "grass, leaves and fruit"),
    ("penguin", "penguins", 2, None, "in cold places near the sea", "fish"),
    ("dolphin", "dolphins", 0, "click", "in the sea", "fish"),
    ("snake", "snakes", 0, "hiss", "in many warm places", "mice and eggs"),
    ("chicken", "chickens", 2, "cluck", "on farms", "seeds and grain"),
    ("goat", "goats", 4, "bleat", "on farms and mountains", "grass and leaves"),
    ("mouse", "mice", 4, "squeak", "in fields and houses", "seeds and grain"),
    ("whale", "whales", 0, None, "in the ocean", "small fish and krill"),
    ("squirrel", "squirrels", 4, None, "in trees", "nuts and seeds"),
    ("turtle", "turtles", 4, None, "in the sea and near lakes", "plants and small animals"),
    ("crab", "crabs", 10, None, "on beaches and in the sea", "small animals and plants"),
)

COLOURS = ("red", "blue", "green", "yellow", "orange", "purple", "black", "white", "brown", "grey", "pink")
FRUITS = ("apple", "banana", "orange", "pear", "grape", "cherry", "lemon", "peach", "plum", "mango", "melon")
VEGETABLES = ("carrot", "potato", "tomato", "onion", "bean", "pea", "cabbage", "pepper", "lettuce", "leek")
OBJECTS = (
    "lantern", "book", "key", "map", "box", "letter", "coin", "clock", "bell", "ring", "boat", "kite", "hat",
    "umbrella", "bottle", "basket", "candle", "mirror", "ladder", "drum",
)  # fmt: skip
PLACES = (
    "a small village", "a quiet town by the river", "a house at the edge of the forest", "a busy city",
    "a farm on the hill", "a town on an island", "a valley between two mountains", "a little harbour",
    "a garden full of flowers", "an old castle",
)  # fmt: skip
ADJECTIVES = (
    "small", "brave", "clever", "curious", "quiet", "kind", "old", "young", "happy", "shy", "busy", "gentle",
)  # fmt: skip
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
)  # fmt: skip
NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
)  # fmt: skip
OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("happy", "sad"), ("old", "new"),
    ("light", "dark"), ("open", "closed"), ("early", "late"), ("full", "empty"), ("high", "low"),
    ("strong", "weak"), ("wet", "dry"), ("easy", "hard"), ("loud", "quiet"), ("long", "short"),
)  # fmt: skip
WEATHER = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy")

# Short questions with one fixed answer each.
FACTS = (
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What colour is grass?", "Grass is green."),
    ("What colour is snow?", "Snow is white."),
    ("How many days are there in a week?", "There are seven days in a week."),
    ("How many months are there in a year?", "There are twelve months in a year."),
    ("How many hours are there in a day?", "There are twenty four hours in a day."),
    ("How many minutes are there in an hour?", "There are sixty minutes in an hour."),
    ("How many seconds are there in a minute?", "There are sixty seconds in a minute."),
    ("How many days are there in a year?", "A year has 365 days, and a leap year has 366."),
    ("Which planet is closest to the sun?", "Mercury is the closest planet to the sun."),
    ("Which planet do we live on?", "We live on the planet Earth."),
    ("What is the largest planet?", "Jupiter is the largest planet in our solar system."),
    ("What is the sun?", "The sun is a star. It gives the Earth light and heat."),
    ("What is the moon?", "The moon is a ball of rock that goes around the Earth."),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
    ("At what temperature does water freeze?", "Water freezes at zero degrees Celsius."),
    ("At what temperature does water boil?", "Water boils at one hundred degrees Celsius at sea level."),
    ("What do plants need to grow?", "Plants need water, light, air and good soil to grow."),
    ("What do bees make?", "Bees make honey and wax."),
    ("Where does rain come from?", "Rain falls from clouds when the drops of water in them grow heavy."),
    ("Why do leaves fall in autumn?", "Many trees drop their leaves in autumn to save water during the cold months."),
    ("What is the opposite of day?", "The opposite of day is night."),
    ("What is a noun?", "A noun is a word for a person, a place or a thing, such as river or teacher."),
    ("What is a verb?", "A verb is a word for an action, such as run, read or write."),
    ("What is an adjective?", "An adjective is a word that describes a noun, such as small or blue."),
    ("What is a sentence?", "A sentence is a group of words that says something complete."),
    ("What is a computer?", "A computer is a machine that follows instructions to work with numbers and data."),
    ("What is a program?", "A program is a list of instructions that a computer follows."),
    ("What is Python?", "Python is a programming language. It is easy to read and is used for many tasks."),
    ("What is JSON?", "JSON is a text format for data. It uses objects with keys and values, and lists."),
    ("What is a function?", "A function is a named piece of code that takes inputs and returns a result."),
    ("What is a list in Python?", "A list is an ordered collection of values, written between square brackets."),
    ("What is a dictionary in Python?", "A dictionary maps keys to values, written between curly braces."),
    ("What is a token?", "A token is a small piece of text, such as a word or part of a word."),
    ("What is a language model?", "A language model predicts the next token of a text, one token at a time."),
    ("What is the internet?", "The internet is a network that connects computers all over the world."),
    ("What is a library?", "A library is a place where people can read and borrow books."),
    ("What is a map?", "A map is a drawing of a place that shows where things are."),
    ("What is a river?", "A river is a large stream of water that flows to a lake or the sea."),
    ("What is a mountain?", "A mountain is a very high hill with steep sides."),
    ("What is an island?", "An island is a piece of land with water all around it."),
    ("What is the biggest ocean?", "The Pacific Ocean is the biggest ocean."),
    ("What is the longest river?", "The Nile and the Amazon are the longest rivers in the world."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("What is the largest animal?", "The blue whale is the largest animal."),
    ("What gas do people breathe in?", "People breathe in oxygen and breathe out carbon dioxide."),
    ("What is a clock for?", "A clock shows the time."),
    ("What is an umbrella for?", "An umbrella keeps you dry in the rain."),
    ("What is a key for?", "A key opens and closes a lock."),
    ("Who wrote the program?", "The team wrote it together over several months."),
    ("What is a good way to learn?", "Practise a little every day, and ask questions when something is not clear."),
    ("What is the first month of the year?", "January is the first month of the year."),
    ("What is the last month of the year?", "December is the last month of the year."),
    ("What is the first day of the week?", "Many people count Monday as the first day of the week."),
    ("What are the four seasons?", "The four seasons are spring, summer, autumn and winter."),
    ("What are the primary colours?", "The primary colours are red, yellow and blue."),
    ("How many continents are there?", "There are seven continents."),
    ("How many legs does a table usually have?", "A table usually has four legs."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("What do you call a baby dog?", "A baby dog is called a puppy."),
    ("What do you call a baby cow?", "A baby cow is called a calf."),
    ("What do you call a baby sheep?", "A baby sheep is called a lamb."),
    ("What do you call a group of birds?", "A group of birds is called a flock."),
)

# Explanations by topic: the user names the topic, the assistant uses a few of its sentences in order.
TOPICS = (
    (
        "how a language model generates text",
        (
            "A language model reads the prompt as a sequence of tokens.",
            "At each step it gives a probability to every token in its vocabulary.",
            "It picks one token, appends it to the text, and repeats.",
            "It stops when it produces an end token or reaches the maximum length.",
            "Settings such as temperature, top-k and top-p control how the next token is chosen.",
        ),
    ),
    (
        "temperature",
        (
            "Temperature changes how the model picks the next token.",
            "A low temperature makes the most likely token even more likely, so the output is steady.",
            "A high temperature flattens the choices, which gives more variety but also more mistakes.",
            "A temperature of zero means the model always takes the most likely token.",
        ),
    ),
    (
        "the water cycle",
        (
            "The sun warms the water in seas, lakes and rivers.",
            "Some of the water turns into vapour and rises into the air.",
            "High in the sky the vapour cools and forms clouds.",
            "When the drops in the clouds grow heavy, they fall as rain or snow.",
            "The water flows back to the rivers and the sea, and the cycle starts again.",
        ),
    ),
    (
        "photosynthesis",
        (
            "Photosynthesis is how plants make their own food.",
            "Leaves take in light from the sun, water from the soil and carbon dioxide from the air.",
            "With this they make sugar, which gives the plant energy to grow.",
            "As they do it, plants give out oxygen, which people and animals breathe.",
        ),
    ),
    (
        "gardening",
        (
            "A garden needs water, light and good soil.",
            "Seeds planted in spring grow into plants by summer.",
            "Pull out weeds so that they do not take the water your plants need.",
            "Water in the morning or in the evening, when the sun is not too strong.",
            "Gardening teaches patience, because plants do not grow faster when you watch them.",
        ),
    ),
    (
        "cooking",
        (
            "Good cooking starts with fresh food and a clean kitchen.",
            "Read the whole recipe before you begin.",
            "Cut the vegetables into pieces of the same size so that they cook evenly.",
            "Taste the food as you cook, and add salt a little at a time.",
            "Simple dishes made with care are often the best.",
        ),
    ),
    (
        "learning a language",
        (
            "Learning a language takes patience.",
            "At first every word is strange, but after a few weeks simple phrases feel natural.",
            "Practise a little every day instead of a lot once a week.",
            "Listen to people speak, read short texts and say the words aloud.",
            "Do not worry about mistakes; they are part of learning.",
        ),
    ),
    (
        "computers",
        (
            "A computer does exactly what it is told.",
            "If the instructions are correct, the result is fast and reliable.",
            "If there is a mistake, the computer repeats that mistake without complaint.",
            "That is why programmers test their code carefully.",
        ),
    ),
    (
        "programming",
        (
            "Programming is writing instructions for a computer.",
            "A program is made of small functions, each with one clear job.",
            "Good names make code easy to read.",
            "Tests check that the code does what it should.",
            "When something breaks, read the error message first; it often says what is wrong.",
        ),
    ),
    (
        "sleep",
        (
            "Sleep helps the body and the mind rest.",
            "Most adults need seven to nine hours of sleep each night.",
            "Going to bed at the same time every day makes sleep easier.",
            "A dark, quiet and cool room helps you sleep well.",
        ),
    ),
    (
        "exercise",
        (
            "Exercise keeps the heart and the muscles strong.",
            "A walk of thirty minutes a day is a good start.",
            "Choose something you enjoy, such as swimming, dancing or riding a bicycle.",
            "Drink water and rest when you are tired.",
        ),
    ),
    (
        "the moon",
        (
            "The moon goes around the Earth about once a month.",
            "It has no light of its own; it reflects the light of the sun.",
            "As it moves, we see more or less of its bright side, which gives the phases of the moon.",
            "The moon also pulls on the sea and causes the tides.",
        ),
    ),
    (
        "the seasons",
        (
            "The Earth is tilted as it goes around the sun.",
            "When your half of the Earth leans towards the sun, you have summer.",
            "When it leans away, you have winter, with short days and cold nights.",
            "Spring and autumn come in between.",
        ),
    ),
    (
        "music",
        (
            "Music is made of sounds arranged in time.",
            "A melody is a line of notes, and harmony is notes played together.",
            "Rhythm gives music its beat.",
            "Many people learn an instrument by practising short pieces every day.",
        ),
    ),
    (
        "writing",
        (
            "When you write, you do not need long words.",
            "Say what you mean, and say it plainly.",
            "A good sentence has a subject and a verb.",
            "Read your text aloud, cut what is not needed and keep what is clear.",
        ),
    ),
    (
        "saving money",
        (
            "Saving money starts with knowing what you spend.",
            "Write down your costs for a month.",
            "Put a small amount aside every time you are paid.",
            "Buy what you need before what you want.",
        ),
    ),
    (
        "the ocean",
        (
            "The ocean covers most of the Earth.",
            "It is home to fish, whales, dolphins and many small plants.",
            "The water of the ocean is salty.",
            "Waves are made by the wind blowing across the water.",
        ),
    ),
    (
        "bread",
        (
            "Bread is made from flour, water, salt and yeast.",
            "The yeast makes the dough rise by giving off small bubbles of gas.",
            "The dough is shaped and baked in a hot oven.",
            "Fresh bread has a crisp crust and a soft middle.",
        ),
    ),
    (
        "the engine",
        (
            "The engine schedules work in small steps.",
            "Each step takes the waiting requests and decides which of them fit in memory.",
            "It runs the model once for all of them together and streams the new tokens back.",
            "When a request finishes, its memory is released and another request can start.",
        ),
    ),
    (
        "JSON",
        (
            "JSON is a simple text format for data.",
            "An object is written between curly braces and holds keys with values.",
            "A list is written between square brackets.",
            "Values can be strings, numbers, true, false, null, objects or lists.",
        ),
    ),
    (
        "rainbows",
        (
            "A rainbow appears when the sun shines through drops of rain.",
            "Each drop bends the light and splits it into colours.",
            "The colours are red, orange, yellow, green, blue and violet.",
            "You see a rainbow when the sun is behind you and the rain is in front of you.",
        ),
    ),
    (
        "trains",
        (
            "Trains run on rails and can carry many people at once.",
            "Fast trains connect large cities in a few hours.",
            "A train uses less energy per person than a car.",
            "Many people read or work while they travel by train.",
        ),
    ),
)

# Advice lists: (what the tips are about, tips)
TIPS = (
    ("learning a language", ("Practise every day.", "Read short stories.", "Speak with other people.",
                             "Learn the most common words first.", "Listen to songs and radio.")),
    ("sleeping well", ("Go to bed at the same time.", "Keep your room dark and quiet.", "Avoid coffee in the evening.",
                       "Put your phone away before bed.", "Get some light in the morning.")),
    ("writing clearly", ("Use short sentences.", "Say one thing at a time.", "Cut words you do not need.",
                         "Read your text aloud.", "Choose plain words.")),
    ("staying healthy", ("Walk every day.", "Drink enough water.", "Eat fruit and vegetables.", "Sleep well.",
                         "Take breaks from the screen.")),
    ("writing good code", ("Give things clear names.", "Keep functions small.", "Write tests.",
                           "Read the error message.", "Ask a friend to review your code.")),
    ("saving money", ("Track what you spend.", "Cook at home.", "Set a monthly budget.", "Save a little every week.",
                      "Wait a day before you buy something expensive.")),
    ("studying", ("Study in short sessions.", "Take notes in your own words.", "Test yourself.",
                  "Explain the idea to someone else.", "Rest between sessions.")),
    ("gardening", ("Water in the morning.", "Pull out weeds early.", "Plant seeds in spring.",
                   "Give plants enough light.", "Use good soil.")),
    ("travelling", ("Pack light.", "Keep a copy of your documents.", "Learn a few words of the local language.",
                    "Check the weather before you go.", "Carry some water.")),
    ("cooking", ("Read the recipe first.", "Keep your knives sharp.", "Taste as you cook.", "Clean as you go.",
                 "Start with simple dishes.")),
)  # fmt: skip

GREETINGS = (
    "Hello!", "Hi", "Hi!", "Hello", "Hello there!", "Hi there!", "Hey!", "Good morning!", "Good evening!",
    "Hello, how are you?", "Hi, how are you doing?", "Hey, what's up?", "Good afternoon.", "Hello there, who are you?",
    "Hi, who are you?", "Hello! Can you help me?", "Hi, I need some help.", "Hey there, how is your day?",
)  # fmt: skip
GREETING_REPLIES = (
    "Hello! How can I help you today?",
    "Hi! How can I help you today?",
    "Hello! I am a small assistant. What would you like to talk about?",
    "Hi there! What can I do for you?",
    "Hello! I am here to help. What do you need?",
    "Hello! It is nice to meet you. How can I help?",
)
WHO_REPLIES = (
    "I am a small language model. I can answer simple questions, write short texts and produce JSON.",
    "I am a tiny assistant trained on a small set of texts. I can chat, answer questions and call tools.",
    "I am a small model that runs on the ordinal engine. Ask me a question and I will do my best.",
)
HOW_ARE_YOU_REPLIES = (
    "I am fine, thank you. How can I help you today?",
    "I am doing well, thank you for asking. What can I do for you?",
    "All is well here. What would you like to know?",
)
THANKS = ("Thank you!", "Thanks!", "Thanks a lot.", "Great, thank you.", "That helps, thanks.")
THANKS_REPLIES = (
    "You are welcome!",
    "You are welcome. Let me know if you have another question.",
    "Happy to help!",
    "Glad I could help.",
)
GOODBYES = ("Bye!", "Goodbye.", "See you later.", "That is all for now.")
GOODBYE_REPLIES = ("Goodbye! Have a nice day.", "Bye! Come back any time.", "See you later!")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a friendly assistant.",
    "You are terse.",
    "Answer in one short sentence.",
    "You are a careful assistant that answers in plain words.",
)
REFUSALS = (
    "I am sorry, I cannot check that. I do not have access to live information.",
    "I cannot do that, but I can answer simple questions or write a short text.",
    "I do not know that. I am a small model and know only a few things.",
)

# Words for generic JSON records: (key, kind) where kind picks a value generator in the corpus.
RECORD_FIELDS = (
    ("name", "name"), ("first_name", "name"), ("last_name", "surname"), ("city", "city"), ("country", "country"),
    ("age", "age"), ("id", "id"), ("email", "email"), ("title", "title"), ("description", "sentence"),
    ("price", "price"), ("quantity", "small_int"), ("count", "small_int"), ("score", "score"), ("active", "bool"),
    ("enabled", "bool"), ("verified", "bool"), ("tags", "tags"), ("status", "status"), ("colour", "colour"),
    ("color", "colour"), ("date", "date"), ("year", "year"), ("rating", "rating"), ("url", "url"),
    ("phone", "phone"), ("language", "language"), ("category", "category"), ("note", "sentence"),
    ("message", "sentence"), ("type", "category"), ("level", "small_int"), ("priority", "priority"),
    ("weight", "price"), ("height", "small_int"), ("summary", "sentence"), ("answer", "answer"),
    ("reason", "sentence"), ("street", "street"), ("zip", "zip"), ("code", "code"), ("version", "version"),
    ("temperature", "temperature"), ("unit", "unit"), ("items", "tags"), ("value", "small_int"),
    ("label", "title"), ("username", "username"), ("animal", "animal"), ("fruit", "fruit"),
)  # fmt: skip
SURNAMES = ("Smith", "Jones", "Garcia", "Müller", "Rossi", "Silva", "Kim", "Novak", "Brown", "Larsen", "Costa")
STATUSES = ("active", "pending", "done", "open", "closed", "failed", "draft")
CATEGORIES = ("book", "food", "music", "sport", "travel", "tool", "game", "science", "news", "health")
PRIORITIES = ("low", "medium", "high")
LANGUAGES = ("English", "French", "German", "Spanish", "Italian", "Japanese", "Portuguese", "Dutch")
TITLES = (
    "A Walk in the Park", "The Blue Door", "Notes on Bread", "Morning Light", "The Last Train", "Small Steps",
    "A House by the Sea", "The Red Kite", "Winter Garden", "Letters Home", "First Report", "Weekly Plan",
)  # fmt: skip
STREETS = ("Main Street", "Park Road", "River Lane", "Hill Street", "Station Road", "Market Square")
SHORT_SENTENCES = (
    "All good.", "It works.", "Ready to ship.", "Needs review.", "Left at the door.", "Call before noon.",
    "A short note.", "Fresh and warm.", "Back next week.", "Done on time.", "Very helpful.", "Open on Sunday.",
)  # fmt: skip

# Tools. Each: (name, description, parameters as (name, kind, description, required)).
# Kinds: city, unit, zone, text, email, subject, number, small_int, currency, symbol, time, date, room, bool,
# language, song, ingredient, country, query, title, people.
TOOLS = (
    ("get_weather", "Get the current weather in a city",
     (("city", "city", "The city name", True), ("unit", "unit", "c for Celsius or f for Fahrenheit", True))),
    ("get_time", "Get the current time in a time zone",
     (("zone", "zone", "The time zone", True),)),
    ("search_web", "Search the web for a query",
     (("query", "query", "What to search for", True), ("limit", "small_int", "How many results", False))),
    ("send_email", "Send an email",
     (("to", "email", "The address", True), ("subject", "subject", "The subject line", True),
      ("body", "text", "The message", True))),
    ("convert_currency", "Convert an amount of money from one currency to another",
     (("amount", "number", "The amount", True), ("from_currency", "currency", "Currency code to convert from", True),
      ("to_currency", "currency", "Currency code to convert to", True))),
    ("add_numbers", "Add two numbers",
     (("a", "number", "The first number", True), ("b", "number", "The second number", True))),
    ("get_stock_price", "Get the price of a stock",
     (("symbol", "symbol", "The stock symbol", True),)),
    ("book_table", "Book a table at a restaurant",
     (("restaurant", "title", "The restaurant", True), ("people", "people", "Number of people", True),
      ("time", "time", "The time, like 19:30", True))),
    ("set_alarm", "Set an alarm",
     (("time", "time", "The time, like 07:00", True), ("label", "subject", "A label", False))),
    ("translate_text", "Translate a text into another language",
     (("text", "text", "The text", True), ("language", "language", "The target language", True))),
    ("create_event", "Add an event to the calendar",
     (("title", "subject", "The event title", True), ("date", "date", "The date, like 2025-05-01", True))),
    ("get_population", "Get the population of a country",
     (("country", "country", "The country", True),)),
    ("find_recipe", "Find a recipe with an ingredient",
     (("ingredient", "ingredient", "The main ingredient", True), ("vegetarian", "bool", "Only vegetarian", False))),
    ("play_music", "Play a song",
     (("song", "song", "The song title", True),)),
    ("get_distance", "Get the distance between two cities in kilometres",
     (("origin", "city", "Where to start", True), ("destination", "city", "Where to go", True))),
    ("turn_on_light", "Turn on the light in a room",
     (("room", "room", "The room", True), ("brightness", "small_int", "Brightness from 1 to 10", False))),
)  # fmt: skip
TIME_ZONES = ("utc", "cet", "pst", "est", "jst", "gmt")
CURRENCIES = ("EUR", "USD", "GBP", "JPY", "CHF", "SEK", "CAD")
SYMBOLS = ("ACME", "GLOBX", "INIT", "NOVA", "ORBT", "PIXL", "ZETA")
ROOMS = ("kitchen", "bedroom", "living room", "office", "garage", "hall", "bathroom")
SONGS = ("Morning Light", "The Red Kite", "Blue River", "Small Steps", "Summer Rain", "Long Road Home")
RESTAURANTS = ("The Green Table", "Luna", "Casa Rosa", "The Old Mill", "Blue Fish", "Corner Cafe")
SEARCH_QUERIES = (
    "how to bake bread", "best time to plant tomatoes", "how tall is a giraffe", "easy pasta recipe",
    "train times to the city", "how to learn python", "why is the sky blue", "good books for children",
)  # fmt: skip

# Story pieces. {name}, {animal}, {adj}, {place}, {object} are filled in by the generator.
STORY_OPENINGS = (
    "Once upon a time there was a {adj} {animal} named {name} who lived in {place}.",
    "Long ago, in {place}, lived a {adj} {animal} called {name}.",
    "In {place} there lived a {adj} {animal}. Everyone called it {name}.",
    "{name} was a {adj} {animal} who lived in {place}.",
)
STORY_HABITS = (
    "Every morning {name} walked down to the river to drink.",
    "Every evening {name} climbed the hill to watch the lights of the village.",
    "Each day {name} looked for food and came home before dark.",
    "{name} liked to sit in the sun and listen to the birds.",
    "{name} spent the days exploring the paths around the house.",
)
STORY_EVENTS = (
    "One day {name} found a {object} hidden under a pile of leaves.",
    "One night a storm came, and the wind blew a {object} right to the door.",
    "One morning {name} saw a strange {object} floating down the river.",
    "One afternoon an old friend arrived with a {object} and a story to tell.",
    "One day {name} heard a small voice calling for help.",
)
STORY_MIDDLES = (
    "{name} was curious and decided to follow the path to see where it led.",
    "At first {name} was afraid, but then took a deep breath and went closer.",
    "{name} asked the other animals what to do, and together they made a plan.",
    "{name} thought about it for a long time and then had a clever idea.",
)
STORY_ENDINGS = (
    "In the end everyone was safe, and {name} went home happy.",
    "From that day on, {name} was known as the bravest {animal} in the land.",
    "{name} kept the {object} and remembered that day for the rest of the year.",
    "The friends shared a meal, laughed together, and went to sleep under the stars.",
    "And that is how {name} learned that a little courage goes a long way.",
)
