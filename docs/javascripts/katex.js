// Render the maths that pymdownx.arithmatex marks (generic mode: \( \) inline, \[ \] display)
// with KaTeX, on first load and after each instant-navigation page change of the theme.
function refdmlRenderMath() {
  if (typeof renderMathInElement === "undefined") {
    return;
  }
  document.querySelectorAll(".arithmatex").forEach(function (element) {
    renderMathInElement(element, {
      delimiters: [
        {left: "\\(", right: "\\)", display: false},
        {left: "\\[", right: "\\]", display: true},
      ],
      throwOnError: false,
    });
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(refdmlRenderMath);
} else {
  window.addEventListener("load", refdmlRenderMath);
}
