"""Rebuild prompts.parquet: system prompts x documents x questions, shuffled, plus a few bad rows.

Prompts that share a system prompt share a prefix; those that also share a document share a longer one.
Run: python data_samples/make_sample.py
"""

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEMS = [
    "You are a careful reading assistant. Answer using only the document below, in one short sentence.",
    "You are a librarian helping students. Read the document, then answer the question briefly and clearly.",
    "You are a fact checker. Answer the question from the document; if the document does not say, answer 'unknown'.",
]
DOCUMENTS = {
    "paris": "Paris is the capital and largest city of France. It lies on the river Seine in the north of the "
             "country. The city is known for the Eiffel Tower, which was finished in 1889 for a world fair, and "
             "for the Louvre, the most visited art museum in the world. About two million people live in the "
             "city itself, and more than twelve million in its metropolitan area.",
    "honeybee": "The honey bee lives in colonies of tens of thousands of workers, a few hundred drones and a "
                "single queen. Workers collect nectar and pollen from flowers and turn the nectar into honey, "
                "which the colony stores in wax combs as food for winter. A worker bee lives about six weeks in "
                "summer, while the queen can live for several years.",
    "volcano": "Mount Etna, on the east coast of Sicily in Italy, is one of the most active volcanoes in the "
               "world. It is about 3,300 metres high and its eruptions have been recorded for more than two "
               "thousand years. Farmers grow grapes and olives on its slopes because the volcanic soil is very "
               "fertile.",
    "telescope": "The James Webb Space Telescope was launched on 25 December 2021. It observes the universe in "
                 "infrared light with a gold-coated mirror 6.5 metres across, made of eighteen hexagonal "
                 "segments. It orbits the Sun near a point about 1.5 million kilometres from Earth, where a "
                 "large sunshield keeps its instruments cold.",
}
QUESTIONS = [
    "What is the document mainly about?",
    "Give one number mentioned in the document and what it measures.",
    "Where does the subject of the document live or stand?",
    "Write a one-sentence summary of the document.",
]


def main() -> None:
    rows = []
    for s, system in enumerate(SYSTEMS):
        for topic, document in DOCUMENTS.items():
            for q, question in enumerate(QUESTIONS):
                prompt = f"{system}\n\nDocument:\n{document}\n\nQuestion: {question}\nAnswer:"
                rows.append({"prompt": prompt, "topic": topic, "system_index": s, "question_index": q})
    for bad in (None, "", "   \n "):
        rows.append({"prompt": bad, "topic": "bad-input", "system_index": -1, "question_index": -1})
    random.Random(7).shuffle(rows)
    for number, row in enumerate(rows):
        row["id"] = f"sample-{number:03d}"
    table = pa.Table.from_pylist(rows).select(["id", "prompt", "topic", "system_index", "question_index"])
    pq.write_table(table, Path(__file__).with_name("prompts.parquet"))


if __name__ == "__main__":
    main()
