"""Language identification of short math sentences: py3langid vs lingua, for ``LanguageShare``.

A hand-written labelled set: 40 GSM8K-style solution sentences (numbers, prices, units,
``<<a*b=c>>`` calculator annotations, short clauses such as "So she has 12 apples left.") in
English, and the same 40 translated by hand into French, German, Spanish and Bulgarian, the
languages of the Tandem Training juniors' experiments we reproduce. Each sentence is identified
alone, the way ``LanguageShare(unit="sentence")`` sees it (math blanked), by each identifier, with
every language it knows and restricted to the five; accuracy overall and on sentences of at most 6
words, and the time per sentence:

    python benchmarks/language_id.py            # the table in docs/language.md
    python benchmarks/language_id.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import time

from tandem_lit.evaluation.language import IDENTIFIERS, LanguageShare, letters, load_py3langid

LANGUAGES = ["en", "fr", "de", "es", "bg"]
SHORT_WORDS = 6  # "short": at most this many words, numbers included

SENTENCES = {
    "en": [
        "So she has 12 apples left.",
        "He pays $15 in total.",
        "The answer is 42.",
        "Each box holds 8 pencils.",
        "Tom ran 5 miles on Monday.",
        "That leaves 30 - 12 = <<30-12=18>>18 cookies.",
        "She earns $20 per hour, so in 8 hours she earns 20 * 8 = $<<20*8=160>>160.",
        "The train travels 60 miles per hour for 3 hours.",
        "First, we find how many students are in each class.",
        "There are 4 weeks in a month.",
        "So the total cost is 3 * $4 = $12.",
        "Half of the 24 cupcakes were eaten.",
        "John has twice as many marbles as Mary.",
        "Therefore, the farmer sold 45 eggs.",
        "We subtract the money she already spent.",
        "Now add the two amounts together: 15 + 27 = 42.",
        "Each friend gets 6 slices of pizza.",
        "The garden is 10 meters long and 4 meters wide, so its area is 40 square meters.",
        "After giving away 7 stickers, Lily has 23 stickers left.",
        "The store sells 3 shirts for $9 each.",
        "It takes him 45 minutes to walk home.",
        "So we need 5 more buses.",
        "Together they have 56 books.",
        "The price went up by 25%.",
        "Let x be the number of dogs.",
        "She reads 20 pages every day, so in a week she reads 140 pages.",
        "The remaining money is $50 - $32 = $18.",
        "This means the tank is full after 6 hours.",
        "Multiply the number of rows by the number of chairs in each row.",
        "He bought 3 packs of gum.",
        "Sarah is 4 years older than her brother.",
        "The bakery made 120 loaves of bread on Saturday.",
        "Each ticket costs $7, so 5 tickets cost 7 * 5 = <<7*5=35>>35 dollars.",
        "We divide 96 by 4 to get 24.",
        "The answer is 18 cookies.",
        "In total, the class collected 300 cans.",
        "The car uses 1 gallon of gas every 30 miles.",
        "So Mark still needs $65.",
        "Both numbers add up to 100.",
        "There were 9 birds on the fence, and 4 flew away.",
    ],
    "fr": [
        "Il lui reste donc 12 pommes.",
        "Il paie 15 $ au total.",
        "La réponse est 42.",
        "Chaque boîte contient 8 crayons.",
        "Tom a couru 5 miles lundi.",
        "Il reste donc 30 - 12 = <<30-12=18>>18 biscuits.",
        "Elle gagne 20 $ de l'heure, donc en 8 heures elle gagne 20 * 8 = <<20*8=160>>160 $.",
        "Le train roule à 60 miles à l'heure pendant 3 heures.",
        "D'abord, on trouve combien d'élèves il y a dans chaque classe.",
        "Il y a 4 semaines dans un mois.",
        "Le coût total est donc de 3 * 4 $ = 12 $.",
        "La moitié des 24 cupcakes ont été mangés.",
        "Jean a deux fois plus de billes que Marie.",
        "Le fermier a donc vendu 45 œufs.",
        "On soustrait l'argent qu'elle a déjà dépensé.",
        "Additionnons maintenant les deux montants : 15 + 27 = 42.",
        "Chaque ami reçoit 6 parts de pizza.",
        "Le jardin mesure 10 mètres de long et 4 mètres de large, donc son aire est de 40 mètres carrés.",
        "Après avoir donné 7 autocollants, Lily en a encore 23.",
        "Le magasin vend 3 chemises à 9 $ chacune.",
        "Il lui faut 45 minutes pour rentrer à pied.",
        "Il faut donc 5 bus de plus.",
        "Ensemble, ils ont 56 livres.",
        "Le prix a augmenté de 25 %.",
        "Soit x le nombre de chiens.",
        "Elle lit 20 pages par jour, donc en une semaine elle lit 140 pages.",
        "L'argent restant est 50 $ - 32 $ = 18 $.",
        "Le réservoir est donc plein après 6 heures.",
        "On multiplie le nombre de rangées par le nombre de chaises dans chaque rangée.",
        "Il a acheté 3 paquets de chewing-gum.",
        "Sarah a 4 ans de plus que son frère.",
        "La boulangerie a fait 120 pains samedi.",
        "Chaque billet coûte 7 $, donc 5 billets coûtent 7 * 5 = <<7*5=35>>35 dollars.",
        "On divise 96 par 4 pour obtenir 24.",
        "La réponse est 18 biscuits.",
        "Au total, la classe a collecté 300 canettes.",
        "La voiture consomme 1 gallon d'essence tous les 30 miles.",
        "Marc a donc encore besoin de 65 $.",
        "Les deux nombres font 100 au total.",
        "Il y avait 9 oiseaux sur la clôture, et 4 se sont envolés.",
    ],
    "de": [
        "Also hat sie noch 12 Äpfel übrig.",
        "Er zahlt insgesamt 15 $.",
        "Die Antwort ist 42.",
        "Jede Schachtel enthält 8 Bleistifte.",
        "Tom ist am Montag 5 Meilen gelaufen.",
        "Es bleiben also 30 - 12 = <<30-12=18>>18 Kekse übrig.",
        "Sie verdient 20 $ pro Stunde, also verdient sie in 8 Stunden 20 * 8 = <<20*8=160>>160 $.",
        "Der Zug fährt 3 Stunden lang 60 Meilen pro Stunde.",
        "Zuerst finden wir heraus, wie viele Schüler in jeder Klasse sind.",
        "Ein Monat hat 4 Wochen.",
        "Die Gesamtkosten betragen also 3 * 4 $ = 12 $.",
        "Die Hälfte der 24 Muffins wurde gegessen.",
        "Johann hat doppelt so viele Murmeln wie Maria.",
        "Der Bauer hat also 45 Eier verkauft.",
        "Wir ziehen das Geld ab, das sie schon ausgegeben hat.",
        "Jetzt addieren wir die beiden Beträge: 15 + 27 = 42.",
        "Jeder Freund bekommt 6 Stück Pizza.",
        "Der Garten ist 10 Meter lang und 4 Meter breit, also ist seine Fläche 40 Quadratmeter.",
        "Nachdem sie 7 Aufkleber verschenkt hat, hat Lily noch 23 Aufkleber.",
        "Der Laden verkauft 3 Hemden für je 9 $.",
        "Er braucht 45 Minuten, um nach Hause zu gehen.",
        "Wir brauchen also 5 weitere Busse.",
        "Zusammen haben sie 56 Bücher.",
        "Der Preis ist um 25 % gestiegen.",
        "Sei x die Anzahl der Hunde.",
        "Sie liest jeden Tag 20 Seiten, also liest sie in einer Woche 140 Seiten.",
        "Das restliche Geld beträgt 50 $ - 32 $ = 18 $.",
        "Der Tank ist also nach 6 Stunden voll.",
        "Multipliziere die Anzahl der Reihen mit der Anzahl der Stühle in jeder Reihe.",
        "Er hat 3 Packungen Kaugummi gekauft.",
        "Sarah ist 4 Jahre älter als ihr Bruder.",
        "Die Bäckerei hat am Samstag 120 Brote gebacken.",
        "Jede Karte kostet 7 $, also kosten 5 Karten 7 * 5 = <<7*5=35>>35 Dollar.",
        "Wir teilen 96 durch 4 und erhalten 24.",
        "Die Antwort ist 18 Kekse.",
        "Insgesamt hat die Klasse 300 Dosen gesammelt.",
        "Das Auto verbraucht alle 30 Meilen 1 Gallone Benzin.",
        "Mark braucht also noch 65 $.",
        "Beide Zahlen ergeben zusammen 100.",
        "Auf dem Zaun saßen 9 Vögel, und 4 flogen weg.",
    ],
    "es": [
        "Así que le quedan 12 manzanas.",
        "Él paga 15 $ en total.",
        "La respuesta es 42.",
        "Cada caja tiene 8 lápices.",
        "Tom corrió 5 millas el lunes.",
        "Quedan 30 - 12 = <<30-12=18>>18 galletas.",
        "Ella gana 20 $ por hora, así que en 8 horas gana 20 * 8 = <<20*8=160>>160 $.",
        "El tren viaja a 60 millas por hora durante 3 horas.",
        "Primero, calculamos cuántos estudiantes hay en cada clase.",
        "Un mes tiene 4 semanas.",
        "Entonces el costo total es 3 * 4 $ = 12 $.",
        "Se comieron la mitad de los 24 pastelitos.",
        "Juan tiene el doble de canicas que María.",
        "Por lo tanto, el granjero vendió 45 huevos.",
        "Restamos el dinero que ya gastó.",
        "Ahora sumamos las dos cantidades: 15 + 27 = 42.",
        "Cada amigo recibe 6 porciones de pizza.",
        "El jardín mide 10 metros de largo y 4 metros de ancho, así que su área es de 40 metros cuadrados.",
        "Después de regalar 7 pegatinas, a Lily le quedan 23.",
        "La tienda vende 3 camisas a 9 $ cada una.",
        "Tarda 45 minutos en caminar a casa.",
        "Así que necesitamos 5 autobuses más.",
        "Juntos tienen 56 libros.",
        "El precio subió un 25 %.",
        "Sea x el número de perros.",
        "Lee 20 páginas cada día, así que en una semana lee 140 páginas.",
        "El dinero restante es 50 $ - 32 $ = 18 $.",
        "Esto significa que el tanque se llena después de 6 horas.",
        "Multiplicamos el número de filas por el número de sillas de cada fila.",
        "Compró 3 paquetes de chicle.",
        "Sara tiene 4 años más que su hermano.",
        "La panadería hizo 120 panes el sábado.",
        "Cada boleto cuesta 7 $, así que 5 boletos cuestan 7 * 5 = <<7*5=35>>35 dólares.",
        "Dividimos 96 entre 4 para obtener 24.",
        "La respuesta es 18 galletas.",
        "En total, la clase recogió 300 latas.",
        "El coche gasta 1 galón de gasolina cada 30 millas.",
        "Entonces Marcos todavía necesita 65 $.",
        "Los dos números suman 100.",
        "Había 9 pájaros en la cerca y 4 se fueron volando.",
    ],
    "bg": [
        "Значи ѝ остават 12 ябълки.",
        "Той плаща общо 15 долара.",
        "Отговорът е 42.",
        "Всяка кутия съдържа 8 молива.",
        "Том пробяга 5 мили в понеделник.",
        "Остават 30 - 12 = <<30-12=18>>18 бисквитки.",
        "Тя печели 20 долара на час, така че за 8 часа печели 20 * 8 = <<20*8=160>>160 долара.",
        "Влакът се движи с 60 мили в час в продължение на 3 часа.",
        "Първо намираме колко ученици има във всеки клас.",
        "В един месец има 4 седмици.",
        "Значи общата цена е 3 * 4 = 12 долара.",
        "Половината от 24-те кексчета бяха изядени.",
        "Иван има два пъти повече топчета от Мария.",
        "Следователно фермерът е продал 45 яйца.",
        "Изваждаме парите, които тя вече е похарчила.",
        "Сега събираме двете суми: 15 + 27 = 42.",
        "Всеки приятел получава 6 парчета пица.",
        "Градината е дълга 10 метра и широка 4 метра, така че площта ѝ е 40 квадратни метра.",
        "След като подари 7 стикера, на Лили ѝ остават 23.",
        "Магазинът продава 3 ризи по 9 долара всяка.",
        "Отнема му 45 минути да се прибере пеша.",
        "Значи ни трябват още 5 автобуса.",
        "Заедно те имат 56 книги.",
        "Цената се е повишила с 25 %.",
        "Нека x е броят на кучетата.",
        "Тя чете по 20 страници на ден, така че за една седмица прочита 140 страници.",
        "Останалите пари са 50 - 32 = 18 долара.",
        "Това означава, че резервоарът е пълен след 6 часа.",
        "Умножаваме броя на редовете по броя на столовете на всеки ред.",
        "Той купи 3 пакета дъвки.",
        "Сара е с 4 години по-голяма от брат си.",
        "Пекарната изпече 120 хляба в събота.",
        "Всеки билет струва 7 долара, така че 5 билета струват 7 * 5 = <<7*5=35>>35 долара.",
        "Делим 96 на 4 и получаваме 24.",
        "Отговорът е 18 бисквитки.",
        "Общо класът събра 300 кутийки.",
        "Колата харчи 1 галон бензин на всеки 30 мили.",
        "Значи Марк все още се нуждае от 65 долара.",
        "Двете числа дават общо 100.",
        "На оградата имало 9 птици и 4 отлетели.",
    ],
}


# Lines with no language: what an identifier answers for them when math is kept is counted as a
# language by a naive metric (usually English); blanked, they are skipped
MATH_ONLY = [
    "12 * 4 = 48",
    "<<48/2=24>>24",
    "#### 24",
    "30 - 12 = 18",
    "$x^2 + 3x = 10$",
    "\\boxed{24}",
    "3 * $4 = $12",
    "(15 + 27) / 2 = 21",
    "\\frac{1}{2} \\cdot 8 = 4",
    "x = 5",
]


def labelled() -> list[tuple[str, str]]:
    return [(language, sentence) for language, sentences in SENTENCES.items() for sentence in sentences]


def measure(identifier: str, restrict: bool, ignore_math: bool, repeats: int) -> dict:
    """Accuracy and speed of one identifier on every sentence, each identified alone."""
    load_py3langid.cache_clear()
    started = time.perf_counter()
    metric = LanguageShare("en", unit="text", identifier=identifier, languages=LANGUAGES if restrict else None,
                           min_chars=1, ignore_math=ignore_math)
    data = labelled()
    texts = [metric.pieces([("text", sentence)])[0][1] for _, sentence in data]
    predicted = [metric.identifier([text])[0] for text in texts]  # the first pass loads lazy models
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeats):
        for text in texts:
            metric.identifier([text])
    us_per_sentence = (time.perf_counter() - started) / (repeats * len(texts)) * 1e6
    right = [p == language for p, (language, _) in zip(predicted, data)]
    short = [r for r, (_, sentence) in zip(right, data) if len(sentence.split()) <= SHORT_WORDS]
    by_language = {
        lang: sum(r for r, (label, _) in zip(right, data) if label == lang) / len(SENTENCES[lang]) for lang in SENTENCES
    }
    errors = [(language, p, sentence) for r, p, (language, sentence) in zip(right, predicted, data) if not r]
    return {
        "identifier": identifier,
        "languages": "en,fr,de,es,bg" if restrict else "all",
        "math": "blanked" if ignore_math else "kept",
        "accuracy": sum(right) / len(right),
        "short_accuracy": sum(short) / len(short),
        "short_sentences": len(short),
        "by_language": by_language,
        "us_per_sentence": us_per_sentence,
        "setup_s": setup_s,
        "errors": errors,
        "letters": [letters(t) for t in texts],
        "right": right,
    }


def fragments(seed: int = 0) -> list[tuple[str, str]]:
    """Each sentence's words dealt to two authors by a fair coin per word (word-level handoff,
    p = 0.5): each author's words of a sentence are one fragment, as ``share_by_author`` with
    ``unit="sentence"`` sees them. Labelled with the sentence's language."""
    rng = random.Random(seed)
    out = []
    for language, sentence in labelled():
        parts: dict[int, list[str]] = {0: [], 1: []}
        for word in sentence.split():
            parts[rng.random() < 0.5].append(word)
        out.extend((language, " ".join(words)) for words in parts.values() if words)
    return out


def measure_fragments(identifier: str, restrict: bool) -> dict:
    metric = LanguageShare("en", unit="text", identifier=identifier, languages=LANGUAGES if restrict else None,
                           min_chars=1)
    data = fragments()
    texts = [" ".join(text for _, text in metric.pieces([("text", fragment)])) for _, fragment in data]
    predicted = metric.identifier(texts)
    return {"identifier": identifier, "languages": "en,fr,de,es,bg" if restrict else "all",
            "right": [p == language for p, (language, _) in zip(predicted, data)],
            "letters": [letters(t) for t in texts]}


def math_only(identifier: str) -> dict:
    """What each identifier calls the language-free lines, math kept; and how many the metric skips."""
    kept = LanguageShare("en", unit="text", identifier=identifier, ignore_math=False, min_chars=1)
    blanked = LanguageShare("en", unit="text", identifier=identifier)
    calls = kept.identifier([kept.pieces([("text", line)])[0][1] for line in MATH_ONLY])
    return {"identifier": identifier, "called": calls, "skipped": sum(blanked.share(line) is None for line in MATH_ONLY)}


MEMORY_PROBE = """
import sys
from tandem_lit.evaluation.language import LanguageShare
sys.path.insert(0, "benchmarks")
from language_id import LANGUAGES, labelled

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

before = rss()
metric = LanguageShare("en", identifier=sys.argv[1], languages=LANGUAGES if sys.argv[2] == "1" else None)
metric.shares([sentence for _, sentence in labelled()])
print(rss() - before)
"""


def memory_mb(identifier: str, restrict: bool) -> float:
    """Resident memory the identifier adds to a fresh process once it has identified the set (MiB, Linux)."""
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, identifier, str(int(restrict))],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
    return float(run.stdout.strip().splitlines()[-1])


def min_chars_sweep(result: dict, thresholds: tuple[int, ...] = (1, 6, 8, 10, 12)) -> list[dict]:
    """What skipping units with few letters (``min_chars``) buys: coverage vs accuracy on the rest."""
    rows = []
    for threshold in thresholds:
        kept = [r for r, n in zip(result["right"], result["letters"]) if n >= threshold]
        rows.append({"min_chars": threshold, "kept": len(kept) / len(result["right"]),
                     "accuracy": sum(kept) / len(kept) if kept else float("nan")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timing passes over the set")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    versions = {name: importlib.metadata.version(package)
                for name, package in (("py3langid", "py3langid"), ("lingua", "lingua-language-detector"))}
    print(f"{len(labelled())} sentences ({', '.join(f'{k} {len(v)}' for k, v in SENTENCES.items())}); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    results = []
    for identifier in IDENTIFIERS:
        for restrict in (False, True):
            for ignore_math in (True, False):
                results.append(measure(identifier, restrict, ignore_math, args.repeats))
    for r in results:
        if r["math"] == "blanked":
            r["memory_mb"] = memory_mb(r["identifier"], r["languages"] != "all")
    print("| identifier | candidates | math | accuracy | <= 6 words | per language (en fr de es bg) | µs / sentence | setup s | memory MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        langs = " ".join(f"{r['by_language'][lang]:.2f}" for lang in LANGUAGES)
        # lingua keeps loaded models for the life of the process: only the first row of a candidate set pays setup
        memory = f"{r['memory_mb']:.0f}" if "memory_mb" in r else "-"
        print(f"| {r['identifier']} {versions[r['identifier']]} | {r['languages']} | {r['math']} | {r['accuracy']:.3f} | "
              f"{r['short_accuracy']:.3f} (n={r['short_sentences']}) | {langs} | {r['us_per_sentence']:.0f} | {r['setup_s']:.1f} | {memory} |")
    print()
    for r in results:
        if r["math"] == "blanked":
            sweep = ", ".join(f"{row['min_chars']}: kept {row['kept']:.2f} acc {row['accuracy']:.3f}" for row in min_chars_sweep(r))
            print(f"min_chars sweep, {r['identifier']} / {r['languages']}: {sweep}")
    print()
    for identifier in IDENTIFIERS:
        for restrict in (False, True):
            r = measure_fragments(identifier, restrict)
            sweep = ", ".join(f"{row['min_chars']}: kept {row['kept']:.2f} acc {row['accuracy']:.3f}" for row in min_chars_sweep(r))
            print(f"author fragments (word handoff), {r['identifier']} / {r['languages']}, n={len(r['right'])}: {sweep}")
    print()
    for identifier in IDENTIFIERS:
        r = math_only(identifier)
        print(f"math-only lines, {identifier}: math kept -> {r['called']}; math blanked -> {r['skipped']}/{len(MATH_ONLY)} skipped")
    print()
    for r in results:
        if r["math"] == "blanked":
            print(f"errors, {r['identifier']} / {r['languages']}:")
            for language, predicted, sentence in r["errors"]:
                print(f"  {language} -> {predicted}: {sentence}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "results": results}, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
