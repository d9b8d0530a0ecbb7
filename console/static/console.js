// The console's only script: "select all" on the dead-letter list, and
// submitting the schema selector on change. Every page works without it.
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      document.querySelectorAll("input.pick").forEach(function (c) { c.checked = all.checked; });
    });
  }
  var schema = document.getElementById("schema-select");
  if (schema && schema.form) {
    schema.addEventListener("change", function () { schema.form.submit(); });
  }
});
