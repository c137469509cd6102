"""The floor every package stands on: the error tree (`errors`), escaping of client-controlled text
for output (`escaping`), and URL credentials kept out of what is shown (`urls`). Standard library only;
nothing here imports another package of the product."""
