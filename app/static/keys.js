() => {
  document.addEventListener('keydown', (e) => {
    const t = e.target;
    if (e.altKey || e.ctrlKey || e.metaKey || (t && (t.isContentEditable || /INPUT|TEXTAREA|SELECT/.test(t.tagName)))) return;
    const id = {n: 'cmp-next', p: 'cmp-prev'}[e.key];
    const b = id && document.getElementById(id);
    if (b) { e.preventDefault(); b.click(); }
  });
}