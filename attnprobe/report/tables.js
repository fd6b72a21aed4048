// Sortable, filterable report tables, offline and dependency-free. Click a column header to sort
// by it (numbers by value: "0.65 [0.36, 0.94]" sorts as 0.65, "12%" as 12; again to reverse); a
// table of five or more rows gets a filter box that keeps the rows containing the typed text. The key-findings table is left as written.
(function () {
  "use strict";

  function key(cell) {
    const text = cell.textContent.trim();
    const number = parseFloat(text.replace(/^[^\d+\-.]*/, ""));
    return Number.isNaN(number) ? text.toLowerCase() : number;
  }

  function compare(a, b) {
    if (typeof a === typeof b) return a < b ? -1 : a > b ? 1 : 0;
    return typeof a === "number" ? -1 : 1; // numbers before text
  }

  function sortBy(table, column, header) {
    const rows = Array.from(table.rows).slice(1);
    const ascending = header.getAttribute("aria-sort") !== "ascending";
    rows.sort(function (r, s) {
      const order = compare(key(r.cells[column]), key(s.cells[column]));
      return ascending ? order : -order;
    });
    Array.from(table.rows[0].cells).forEach(function (th) { th.removeAttribute("aria-sort"); });
    header.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    const body = rows.length ? rows[0].parentNode : table;
    rows.forEach(function (row) { body.appendChild(row); });
  }

  function addFilter(table) {
    const input = document.createElement("input");
    input.type = "search";
    input.placeholder = "filter rows";
    input.className = "table-filter";
    input.addEventListener("input", function () {
      const wanted = input.value.trim().toLowerCase();
      Array.from(table.rows).slice(1).forEach(function (row) {
        row.style.display = !wanted || row.textContent.toLowerCase().includes(wanted) ? "" : "none";
      });
    });
    table.parentNode.insertBefore(input, table);
  }

  document.querySelectorAll("table:not(.findings)").forEach(function (table) {  // findings: read, not sorted
    if (!table.rows.length) return;
    Array.from(table.rows[0].cells).forEach(function (header, column) {
      header.style.cursor = "pointer";
      header.title = "sort by this column";
      header.addEventListener("click", function () { sortBy(table, column, header); });
    });
    if (table.rows.length > 5) addFilter(table);
  });
})();
