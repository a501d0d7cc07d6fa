// MathJax 2, served from the site (docs/hooks.py copies it there), reads the \( \) and \[ \]
// spans pymdownx.arithmatex leaves in generic mode, and nothing else on the page.
window.MathJax = {
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processClass: "arithmatex",
    ignoreClass: ".*",
  },
  // The package carries MathJax's STIX web fonts only: use them, never look for local fonts
  // or image fonts it does not have.
  "HTML-CSS": { availableFonts: [], webFont: "STIX-Web", imageFont: null },
  showMathMenu: false,
  messageStyle: "none",
};
// Material swaps pages in place (instant navigation): typeset each page it shows.
document$.subscribe(() => {
  if (window.MathJax && window.MathJax.Hub) {
    window.MathJax.Hub.Queue(["Typeset", window.MathJax.Hub]);
  }
});
