"""Word lists of the offline generators (plain English, no external corpus needed): data, no code but a splitter."""


def _phrases(text: str) -> list[str]:
    """Split a ``|``-separated block of phrases (line breaks count as spaces)."""
    return [" ".join(phrase.split()) for phrase in text.split("|")]


ADJECTIVES = """
abundant agreeable ancient angry bashful big bitter black blue brave brief bright broad calm careful cheerful
chilly clever cloudy clumsy cold colossal cool crooked curly damp dark deep delightful dry dusty eager early
elegant empty faint fancy fierce flat fresh friendly fuzzy gentle giant gigantic golden grand great green grumpy
handsome happy harsh heavy helpful hollow huge humble icy jolly kind large late lazy little lively long loud
lucky magnificent massive mighty modern narrow neat nervous noisy odd old orange pale plain polite proud purple
quick quiet rapid rare red rich round rough salty scary shallow sharp shiny short shy silent silly slow small
smooth soft sour square steep sticky stormy strong sturdy sweet swift tall tame tender thick thin tiny tough
warm weak wet wide wild wise witty wooden yellow young zealous
""".split()

NOUNS = """
acorn airport anchor apple arrow attic badge bakery balloon bamboo banjo barn basket beacon bell bench bicycle
blanket boat bonnet bottle bridge brook bucket button cabin cactus camera candle canoe canyon carpet castle
cathedral cellar chair chimney circus cliff clock cloud comet compass cottage crayon crown curtain cushion daisy
desert diamond dolphin donkey dragon drum eagle engine envelope falcon feather fence ferry fiddle flag flute
forest fountain garden gate glacier globe glove guitar hammer harbor helmet hill horizon island jacket jar jungle
kettle kite ladder lagoon lamp lantern lemon library lighthouse magnet map marble meadow mirror mountain museum
needle nest notebook oasis ocean orchard owl paddle palace parrot pebble pencil piano pillow planet pond puzzle
quilt rabbit raft rainbow ribbon river rocket saddle sailboat scarf shell shovel sparrow spoon stadium statue
storm stove sunflower table teapot telescope temple thunder tiger tower tractor trumpet tunnel umbrella valley
violin volcano wagon walnut waterfall whistle window windmill wolf yacht zebra
""".split()

VERBS = """
admire arrive bake balance borrow breathe build carry chase clap climb collect cook count crawl dance decide
deliver dig drift dream drive explore fetch fold follow gather glide grow guard hike hover hunt jump knit laugh
launch listen march measure melt mend nod paint paddle plant polish pour pull push race reach read repair rescue
ride roam row sail scatter search settle sew shine sing sketch skip slide sneeze sort spin splash sprint stack
stir stretch swim swing taste throw travel tumble wander wash whisper wiggle wink wonder wrap write yawn
""".split()

# The "noise" haystack of RULER's niah_single_1 and variable tracking.
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Building blocks of the "essay" haystack: varied, harmless prose.
ESSAY_SUBJECTS = _phrases("""
The old lighthouse|A quiet river|The village baker|Our science teacher|The night train|A curious fox|The mountain
road|The city library|An autumn storm|The market square|A young painter|The harbor master|The school choir|An old
sailor|The morning bus|A travelling musician|The town council|A patient gardener|The museum guide|A small bakery
""")

ESSAY_VERBS = _phrases("""
watched over|wound slowly past|talked about|was known for|rattled through|wandered near|climbed toward|kept
records of|swept across|filled up with|dreamed about|wrote letters about|sang songs about|drew pictures of|waited
beside|looked after|walked along|argued about|remembered|carefully studied
""")

ESSAY_OBJECTS = _phrases("""
the sleeping harbour|fields of golden wheat|stories of distant travellers|warm bread at dawn|the valley before
sunrise|the edge of the forest|forgotten maps|every rooftop in town|merchants and musicians|the first snow of the
year|the long summer evenings|a garden full of roses|the narrow stone bridge|old photographs|the noisy seagulls|the
price of apples|a broken compass|the winding canal|children flying kites|the quiet mountain lake
""")

ESSAY_ENDINGS = _phrases("""
for many years|without saying a word|long after midnight|every single morning|while the rain kept falling|as the
bells rang|before the guests arrived|with great patience|in the late afternoon|during the festival|as if nothing had
happened|under a grey sky|with a cheerful smile|until the lamps were lit|once again
""")

# Entities of the QA-like tasks (invented, so the model cannot answer from memory).
TOWN_PREFIXES = """
Bel Cor Dun Fal Gar Hol Kel Lor Mar Nor Pel Quin Ros Sel Tor Val Wen Yar Zel Ash Bram Cal Dor Elm Fen
""".split()
TOWN_SUFFIXES = "mora wick haven ford dale ton bury mouth field stead brook more gate holm ridge combe".split()

FIRST_NAMES = """
Alice Bruno Clara Daniel Elena Felix Grace Hugo Irene Jonas Karin Lucas Maria Nadia Oscar Paula Quentin Rosa
Simon Tessa Ulrich Vera Walter Xenia Yusuf Zoe Amir Bianca Conrad Delia Emil Flora Gustav Hanna Ivan Julia
Kofi Lena Marco Nina
""".split()
LAST_NAMES = """
Abbott Baxter Castell Draper Ellison Fairbanks Garner Hollis Ingram Jarvis Kendrick Lowell Mercer Norland Oakley
Prescott Quimby Redford Sutton Thorne Underwood Vance Whitaker Yardley Zimmer Ashford Brennan Calloway Dunmore
Everett Fletcher Galloway Hartley Irwin Jessop Kingsley Langford Merritt Nash Osborne
""".split()

COMPANY_PREFIXES = """
Apex Bright Cobalt Delta Ember Falcon Granite Harbor Iris Juniper Kestrel Lumen Maple Nimbus Orchid Pioneer
Quartz Raven Summit Tidal Umber Vireo Willow Xylo Zephyr
""".split()
COMPANY_SUFFIXES = "Works Labs Industries Systems Foods Textiles Motors Instruments Press Mills Supply Crafts".split()

PRODUCTS = _phrases("""
wool blankets|copper kettles|glass lanterns|paper kites|leather boots|clay pots|wooden toys|silver spoons|cotton
shirts|bicycle bells|garden tools|wax candles|fishing nets|music boxes|straw hats|brass buttons|rope ladders|tin
whistles|stone bowls|oak barrels|linen towels|chess sets|sailing ropes|pocket watches|maple syrup|honey cakes|rain
coats|iron gates|cheese wheels|ink pens
""")

RIVERS = "Amber Silt Heron Willow Granite Lark Otter Rushy Slate Bramble Cinder Dove Fern Glimmer Hazel Moss".split()

JOBS = """
carpenter librarian pilot baker surveyor teacher photographer engineer nurse tailor blacksmith fisherman
architect gardener clockmaker potter shepherd translator jeweller cartographer
""".split()
