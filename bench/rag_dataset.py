"""A seeded synthetic RAG set: short distinct documents with distinct facts, questions over 4-6 of them in a random order."""
from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = (
    "the Harwick Lighthouse", "the Copperfield Observatory", "the Blue Lantern Club", "the ship Morning Star",
    "the Ashdown Library", "the Gilded Swan Hotel", "the Redmoor Mine", "the Silverleaf Orchard",
    "the Kettleby Bakery", "the Northgate Museum", "the Willowmere Ferry", "the Orchid Street School",
    "the Falkner Brewery", "the Marlow Theatre", "the Stormcrest Fortress", "the Pellham Zoo",
    "the Iron Gate Bridge", "the Brackenridge Farm", "the Coldwater Spa", "the Emberly Glassworks",
    "the Tidewell Harbour", "the Quillon Printing House", "the Rosebay Chapel", "the Granite Peak Railway",
)
# Every answer occurs once in the whole set, so a "contains" match names one fact only.
ANSWERS = {
    "keeper": ("Tomas Reed", "Ada Finch", "Bruno Kade", "Clara Voss", "Dmitri Hale", "Elena Marsh", "Felix Orwin",
               "Greta Lund", "Hugo Brandt", "Iris Calder", "Jonas Pike", "Kira Solberg", "Leo Danner", "Mira Quist",
               "Nils Ander", "Olga Trent", "Pavel Roux", "Rosa Imber", "Sven Talbot", "Tessa Wren", "Umar Hadley",
               "Vera Stoll", "Walter Emms", "Yuki Arden"),
    "password": ("juniper", "marigold", "thunder", "velvet", "pebble", "lantern", "saffron", "harbor", "compass",
                 "meadow", "falcon", "ember", "quartz", "willow", "cascade", "thimble", "orchid", "summit", "biscuit",
                 "kettle", "anchor", "glacier", "prism", "bramble"),
    "official color": ("crimson", "teal", "amber", "violet", "olive", "indigo", "scarlet", "ivory", "maroon", "cobalt",
                       "jade", "coral", "ochre", "lilac", "slate", "bronze", "navy", "plum", "mint", "rust", "azure",
                       "beige", "pearl", "magenta"),
    "mascot": ("otter", "badger", "heron", "lynx", "walrus", "beaver", "condor", "ferret", "gecko", "ibis", "jackal",
               "koala", "lemur", "marmot", "newt", "ocelot", "puffin", "quail", "raven", "salmon", "tapir", "urchin",
               "vulture", "weasel"),
    "oldest tree": ("oak", "beech", "birch", "cedar", "elm", "fir", "hazel", "larch", "maple", "pine", "poplar",
                    "rowan", "spruce", "sycamore", "yew", "alder", "aspen", "chestnut", "cypress", "hawthorn",
                    "hornbeam", "linden", "magnolia", "juniper bush"),
    "lucky number": tuple(str(n) for n in (17, 23, 42, 58, 64, 71, 86, 93, 105, 117, 128, 139, 144, 156, 163, 172,
                                           188, 191, 207, 219, 233, 246, 251, 268)),
    "secret ingredient": ("cinnamon", "nutmeg", "ginger", "vanilla", "cardamom", "clove", "fennel", "paprika",
                          "thyme", "rosemary", "basil", "sage", "mint leaves", "honey", "molasses", "lemon zest",
                          "anise", "sesame", "walnut", "almond", "coconut", "lavender", "pepper", "mustard"),
}
# Filler is drawn per document from templates with random slot values, so documents seldom repeat a
# sentence verbatim (retrieved documents rarely do).
OPENINGS = ("stands in the old quarter of Dunmere.", "was built on the eastern cliffs above the bay.",
            "lies at the end of a long avenue of chestnut trees.", "sits beside the river, near the stone market.",
            "overlooks the northern moors from a low hill.", "can be found behind the railway station.")
SLOTS = {
    "year": tuple(str(y) for y in range(1702, 1899, 7)),
    "people": ("fishermen", "merchants", "students", "pilgrims", "painters", "soldiers", "farmers", "sailors"),
    "season": ("spring", "summer", "autumn", "winter"),
    "material": ("granite", "red brick", "oak beams", "limestone", "slate", "cast iron"),
    "event": ("a flood", "a fire", "a long drought", "a harsh winter", "an earthquake", "a war"),
    "count": ("two", "three", "four", "five", "seven", "nine", "twelve"),
}
FILLER_TEMPLATES = (
    "It was first opened in {year} and quickly became popular with {people}.",
    "Its walls are made of {material}, which weathers slowly in the sea air.",
    "After {event} damaged it, the townsfolk repaired it within {count} years.",
    "Every {season} a small festival is held there for the {people} of the district.",
    "A painting from {year} shows it surrounded by {count} tall poplars.",
    "The {people} who work nearby say it is busiest in {season}.",
    "A plaque by the door recalls {event} that struck the region in {year}.",
    "Guides explain that the original {material} was brought by cart from {count} villages away.",
)
SYSTEM_PROMPT = "Answer the question from the documents."
NUM_FACTS = 4


@dataclass(slots=True, frozen=True)
class Document:
    subject: str
    text: str
    facts: tuple[tuple[str, str], ...]  # (relation, answer)


@dataclass(slots=True, frozen=True)
class Question:
    document_ids: tuple[int, ...]  # the documents in the order the prompt presents them
    target: int  # the document holding the answer
    relation: str
    answer: str

    def ask(self, documents: list[Document]) -> str:
        return f"What is the {self.relation} of {documents[self.target].subject}?"

    def answer_prefix(self, documents: list[Document]) -> str:
        # The assistant turn starts with the question's own words, so the answer comes first.
        return f"The {self.relation} of {documents[self.target].subject} is"


def build_documents(seed: int = 0) -> list[Document]:
    rng = random.Random(seed)
    pools = {relation: rng.sample(answers, len(answers)) for relation, answers in ANSWERS.items()}
    documents = []
    for subject in SUBJECTS:
        relations = rng.sample(sorted(ANSWERS), NUM_FACTS)
        facts = tuple((relation, pools[relation].pop()) for relation in relations)
        fillers = [template.format(**{k: rng.choice(v) for k, v in SLOTS.items()}) for template in rng.sample(FILLER_TEMPLATES, 3)]
        sentences = [f"{subject[0].upper()}{subject[1:]} {rng.choice(OPENINGS)}", fillers[0]]
        for index, (relation, answer) in enumerate(facts):
            sentences.append(f"The {relation} of {subject} is {answer}.")
            if index in (1, 2):
                sentences.append(fillers[index])
        documents.append(Document(subject, " ".join(sentences), facts))
    return documents


def build_questions(documents: list[Document], count: int, seed: int = 1) -> list[Question]:
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        chosen = tuple(rng.sample(range(len(documents)), rng.choice((4, 5, 6))))
        target = rng.choice(chosen)
        relation, answer = rng.choice(documents[target].facts)
        questions.append(Question(chosen, target, relation, answer))
    return questions


def chat_segments(tokenizer, documents: list[Document], question: Question) -> list[str]:
    """[chat header, document..., question + assistant header + answer prefix]; their concatenation is the
    tokenizer's own chat template applied to (system, user) with the answer prefix after it."""
    marker = "\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": marker}],
        tokenize=False, add_generation_prompt=True,
    )
    header, after = rendered.split(marker)
    bodies = [document_segment(documents[i]) for i in question.document_ids]
    return [header, *bodies, f"Question: {question.ask(documents)}{after}{question.answer_prefix(documents)}"]


def document_segment(document: Document) -> str:
    """A document exactly as it is warmed and as it appears inside prompts."""
    return document.text + "\n\n"
