// MathJax reads the \( \) and \[ \] spans pymdownx.arithmatex leaves in generic mode.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};
document$.subscribe(() => MathJax.typesetPromise());
